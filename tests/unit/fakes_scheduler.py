"""In-process fakes for the scheduler's collaborators: a store in memory, a scheduler built over it and the
fake trainers of fakes_trainer.py (re-exported here: FakeTrainer, FakeBackends, MODEL), and the quotas and
admission the verbs read."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

from fakes_trainer import MODEL, FakeBackends, FakeTrainer
from temper.common.errors import AlreadyExists, Unauthenticated, NotFound, Unavailable
from temper.scheduler.db.catalog import RunNumber
from temper.scheduler.db.request_log import LoggedRequest
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.loop import SchedulerLoop
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.tenancy.quotas import Limits
from temper.v1 import service_pb2


class FakeStore:
    """The Store methods admission and the loop use; ``down`` makes every call Unavailable."""

    def __init__(self, add_delay: float = 0.0):
        self.runs: dict[str, SimpleNamespace] = {}
        self.tenants: dict[str, str] = {}   # run id -> tenant
        self.requests: dict[tuple[str, int], SimpleNamespace] = {}
        self.down = False
        self.add_delay = add_delay
        self.limits: dict[str, dict[str, int]] = {}  # tenant -> its own limits (tenant_limits)
        self.lock = threading.Lock()
        self.lookups: list[tuple[str, int]] = []  # get_request calls
        self.marked_ahead: list[tuple[str, int]] = []  # keys finish_requests marked running for the next cycle

    def _check(self):
        if self.down:
            raise Unavailable("the database is unavailable (fake); retry")

    def add_run(self, run_id: str, tenant: str, seed: int | None = 0) -> None:
        self.runs[run_id] = SimpleNamespace(id=run_id, session_id=f"s-{tenant}", base_model=MODEL, next_seq_id=1, trainer=None,
                                            lora_rank=4, lora_alpha=32.0, lora_dropout=0.0, seed=seed, train_attn=True,
                                            train_mlp=True, train_unembed=False, snapshot_key=None, snapshot_seq=None,
                                            restoring=False, lora_expert_rank=0, deterministic=False)
        self.tenants[run_id] = tenant

    def set_tenant_weights(self, weights):
        self._check()

    def tenant_weights(self):
        self._check()
        return {}

    def load_run(self, run_id):
        self._check()
        if run_id not in self.runs:
            raise NotFound(f"training run {run_id!r} not found")
        return self.runs[run_id], self.tenants[run_id], False, max((seq for run, seq in self.requests if run == run_id), default=0)

    def run_owner(self, run_id):
        self._check()
        if run_id not in self.runs:
            raise NotFound(f"training run {run_id!r} not found")
        return self.tenants[run_id]

    def key_of(self, tenant: str) -> str:
        return f"tml-fake-key-of-{tenant}"

    def tenant_for_key(self, key):
        self._check()
        tenant = key.removeprefix("tml-fake-key-of-")
        if tenant == key or tenant not in self.tenants.values():
            raise Unauthenticated("unknown API key")
        return tenant

    def key_identity(self, key):
        from temper.scheduler.db.tenancy import KeyIdentity
        return KeyIdentity(self.tenant_for_key(key), 0, key[:12], False)

    def tenant_limits(self, tenant):
        self._check()
        return self.limits.get(tenant, {})

    def get_request(self, run_id, seq_id):
        self._check()
        self.lookups.append((run_id, seq_id))
        return self.requests.get((run_id, seq_id))

    def add_request(self, run_id, seq_id, kind, sha, status, tokens, error=None, payload=None, delay=True):
        time.sleep(self.add_delay if delay else 0.0)
        self._check()
        with self.lock:
            self.requests[(run_id, seq_id)] = SimpleNamespace(training_run_id=run_id, seq_id=seq_id, kind=kind, payload_sha256=sha,
                                                              status=status, error=error, result=None, num_tokens=tokens,
                                                              payload=payload)

    def add_requests(self, rows):
        time.sleep(self.add_delay)
        self._check()
        outcomes = []
        for row in rows:
            if (row.run_id, row.seq_id) in self.requests:
                outcomes.append(AlreadyExists(f"request {row.run_id} seq {row.seq_id} was already submitted"))
                continue
            self.add_request(*row[:6], row.error, row.payload, delay=False)
            outcomes.append(None)
        return outcomes

    def get_training_run(self, run_id):
        self._check()
        return self.runs[run_id]

    def logged_requests(self, run_id, after_seq, upto_seq):
        self._check()
        return [LoggedRequest(seq, r.kind, r.status, r.num_tokens, r.payload) for (run, seq), r in sorted(self.requests.items())
                if run == run_id and after_seq < seq <= upto_seq]

    def set_restoring(self, run_id, restoring):
        self._check()
        self.runs[run_id].restoring = restoring

    def record_snapshot(self, run_id, key, seq):
        self._check()
        run = self.runs[run_id]
        previous, run.snapshot_key, run.snapshot_seq = run.snapshot_key, key, seq
        for (run_of, seq_of), record in self.requests.items():
            if run_of == run_id and seq_of <= seq:
                record.payload = None
        return previous if previous != key else None  # as Store.record_snapshot

    def move_run(self, run_id, trainer):
        self._check()
        self.runs[run_id].trainer = trainer

    def write_group(self, rows, running):
        self._check()
        if running:
            self.mark_running(running)
        return self.add_requests(rows) if rows else []

    def mark_running(self, keys):
        self._check()
        for key in keys:
            self.requests[key].status = "running"

    def finish_requests(self, outcomes, tokens, steps, next_seq, window=0, metrics=(), running=()):
        self._check()
        for run_id, seq_id, status, error, result in outcomes:
            record = self.requests[(run_id, seq_id)]
            record.status, record.error, record.result = status, error, result
        self.marked_ahead.extend(running)
        for key in running:  # the next cycle's requests, marked in the same transaction (loop.py)
            self.requests[key].status = "running"

    def skip_request(self, run_id, seq_id, queued_too):
        self._check()
        record = self.requests.get((run_id, seq_id))
        if record is None:
            self.add_request(run_id, seq_id, "skipped", "", "skipped", 0, delay=False)
            return "skipped"
        if record.status == "queued" and queued_too:
            record.status, record.kind, record.payload_sha256, record.payload = "skipped", "skipped", "", None
        return record.status

    def skipped_seqs(self, run_id, from_seq):
        self._check()
        return tuple(seq for (run, seq), r in sorted(self.requests.items()) if run == run_id and seq >= from_seq and r.status == "skipped")

    def statuses(self, run_id: str) -> dict[int, str]:
        return {seq: r.status for (run, seq), r in sorted(self.requests.items()) if run == run_id}


class CreatingStore(FakeStore):
    """FakeStore with what CreateTrainingRun adds: sessions, run numbers (given back as the Store does), new rows."""

    def __init__(self, fail_add: bool = False):
        super().__init__()
        self.next_run, self.fail_add = 0, fail_add

    def open_session(self, session_id, tenant):
        pass

    def reserve_run(self, session_id, index=None):
        previous, self.next_run = self.next_run, (self.next_run if index is None else index) + 1
        return RunNumber(f"{session_id}:train:{self.next_run - 1}", self.next_run - 1, previous)

    def give_back_run(self, session_id, number):
        if self.next_run != number.number + 1:
            return False
        self.next_run = number.previous
        return True

    def open_training_runs(self, tenant):
        return sum(1 for owner in self.tenants.values() if owner == tenant)

    def add_training_run(self, row):
        if self.fail_add:
            raise Unavailable("the database did not answer")
        self.runs[row.id], self.tenants[row.id] = row, "alice"


def settings(**overrides) -> SchedulerSettings:
    return SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", **overrides)


class FakeQuotas:
    """Every tenant at the default limits, a fresh storage lock each time: quota checks that pass."""

    async def limits(self, tenant):
        return Limits()

    def storage_lock(self, tenant):
        return asyncio.Lock()


class VerbAdmission:
    """What the copy and import verbs read of Admission: its settings and quotas."""

    settings = settings()
    quotas = FakeQuotas()


@dataclass
class Scheduler:
    store: FakeStore
    trainer: FakeTrainer
    admission: Admission
    loop: SchedulerLoop


def build(store: FakeStore | None = None, trainer: FakeTrainer | None = None, backends: FakeBackends | None = None,
          **overrides) -> Scheduler:
    """``backends``: several trainers (then ``trainer`` is its first)."""
    store = store or FakeStore()
    backends = backends or FakeBackends(trainer or FakeTrainer())
    config = settings(**overrides)
    runs = RunRegistry(store)
    admission = Admission(store, runs, config)
    return Scheduler(store, backends.trainer, admission, SchedulerLoop(admission, backends, store, runs, config))


def fb(run_id: str, seq: int, tokens=(1, 2, 3)) -> service_pb2.ForwardBackwardRequest:
    from temper.client import convert
    from temper.client.types import Datum, ModelInput
    import numpy as np

    datum = Datum(model_input=ModelInput.from_ints(list(tokens)),
                  loss_fn_inputs={"target_tokens": np.asarray(tokens, dtype=np.int64), "weights": np.ones(len(tokens), np.float32)})
    return service_pb2.ForwardBackwardRequest(training_run_id=run_id, seq_id=seq, data=[convert.datum_to_proto(datum)],
                                              loss_fn="cross_entropy")


@contextlib.asynccontextmanager
async def servicer_over_fakes(trainer: FakeTrainer, tenant: str = "alice", **overrides):
    """The public servicer over a CreatingStore and ``trainer``, its loop running, called as ``tenant``:
    yields (the fakes' Scheduler, the servicer)."""
    from temper.scheduler.api.servicer import TemperServicer
    from temper.scheduler.tenancy.auth import reset_caller, set_caller

    s = build(store=CreatingStore(), trainer=trainer, **overrides)
    api = TemperServicer(s.store, FakeBackends(s.trainer), s.admission.runs, s.admission)
    task = asyncio.create_task(s.loop.run_forever())
    token = set_caller(tenant)
    try:
        yield s, api
    finally:
        reset_caller(token)
        task.cancel()
