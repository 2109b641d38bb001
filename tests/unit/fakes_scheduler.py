"""In-process fakes for the scheduler's collaborators: a store in memory and a trainer that applies
each (run, seq) once and answers resent seqs from memory, as the real trainer does."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from temper.common.errors import AlreadyExists, TemperError, Unauthenticated, NotFound, Unavailable, status_number
from temper.scheduler.db.catalog import RunNumber
from temper.scheduler.db.request_log import LoggedRequest
from temper.scheduler.workers.abandon import Calls
from temper.scheduler.workers.backends import Backends
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.loop import SchedulerLoop
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import service_pb2, trainer_pb2

MODEL = "fake-model"


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


@dataclass
class FakeTrainer:
    """Answers fb items with loss:sum = seq; remembers applied seqs per run (and answers them again).
    Runs in ``refuse`` are refused per item, as the real trainer does: their items answer the error's
    status and nothing of them is applied; the other items of the cycle run.

    With ``adapters`` (a dict: run -> its adapter's state, the list of what was applied to it, in
    order) the trainer holds adapters as the real one does: a run without one is refused NotFound,
    an applied seq is answered from that adapter's memory, and ``lose()`` forgets them all (a
    restart); snapshots live in ``store``, shared by the trainers given the same dict. ``down``: every
    call is UNAVAILABLE (a dead trainer). ``log`` lists the calls (restore, create, cycle, ...).
    ``frozen_in``: those calls ("snapshot", "restore", a trainer RPC's name) wait at ``gate`` too (a
    trainer SIGSTOPped mid-call); waits are given up by ``abandon()``, as TrainerHandle's are."""

    address: str = "fake-trainer:1"
    info: trainer_pb2.ModelInfo = field(default_factory=lambda: trainer_pb2.ModelInfo(
        base_model=MODEL, tokenizer_id="fake", vocab_size=100, max_context_length=64))
    delay: float = 0.0
    unreachable_for: int = 0                   # the next N calls fail UNAVAILABLE *after* applying (answer lost)
    refuse: dict[str, TemperError] = field(default_factory=dict)   # run id -> the error its items answer
    gate: asyncio.Event | None = None          # set: calls go on; clear: every call waits for it (a hung trainer)
    applied: list[tuple[str, int]] = field(default_factory=list)
    answers: dict[tuple[str, int], object] = field(default_factory=dict)
    calls: int = 0
    waiting: int = 0                           # calls waiting at the gate now
    frozen_in: tuple[str, ...] = ()
    in_flight: Calls = field(default_factory=lambda: Calls("trainer fake"), repr=False)
    adapters: dict[str, list] | None = None
    store: dict[str, tuple[str, list]] = field(default_factory=dict)   # snapshot key -> (run, state)
    down: bool = False
    log: list = field(default_factory=list)

    def lose(self) -> None:
        self.adapters.clear()

    def abandon(self) -> int:
        return self.in_flight.abandon()

    async def _at_gate(self) -> None:
        self.waiting += 1
        try:
            await self.in_flight.run(self.gate.wait())
        finally:
            self.waiting -= 1

    async def _frozen(self, name: str) -> None:
        if name in self.frozen_in and not self.gate.is_set():
            await self._at_gate()

    def _reach(self) -> None:
        if self.down:
            raise Unavailable(f"trainer {self.address} did not answer (UNAVAILABLE): connection refused")

    def _missing(self, run_id: str) -> NotFound | None:
        if self.adapters is not None and run_id not in self.adapters:
            return NotFound(f"the adapter of run {run_id} is not loaded on this trainer")
        return self.refuse.get(run_id)

    def _applied(self, run_id: str, seq: int) -> bool:
        if self.adapters is None:
            return (run_id, seq) in self.answers
        return any(entry[1] >= seq for entry in self.adapters[run_id] if entry[0] != "load")

    async def ping(self, timeout: float = 2.0) -> bool:
        return not self.down

    async def call(self, method: str, request):
        self._reach()
        await self._frozen(method)
        if method == "DeleteCheckpoint":  # of the snapshots in ``store``
            self.log.append(("delete", request.checkpoint_key))
            return trainer_pb2.DeleteCheckpointFilesResponse(freed_bytes=1 if self.store.pop(request.checkpoint_key, None) else 0)
        run_id = request.training_run_id
        if method == "CreateAdapter":
            if run_id in self.adapters:
                raise AlreadyExists(f"run {run_id} already has an adapter on this trainer")
            self.log.append(("create", run_id, request.lora_config.seed))
            self.adapters[run_id] = []
        elif method == "DropAdapter":
            if self._missing(run_id):
                raise self._missing(run_id)
            self.log.append(("drop", run_id))
            del self.adapters[run_id]
        elif method == "LoadAdapter":
            self.log.append(("load", run_id, request.checkpoint_key))
            self.adapters[run_id].append(("load", request.checkpoint_key))
        else:
            raise NotImplementedError(method)
        return None

    async def snapshot(self, run_id: str, key: str):
        self._reach()
        await self._frozen("snapshot")
        if self._missing(run_id):
            raise self._missing(run_id)
        if key in self.store:
            raise AlreadyExists(f"checkpoint {key} already exists")
        self.log.append(("snapshot", run_id, key))
        self.store[key] = (run_id, list(self.adapters[run_id]))
        return trainer_pb2.SnapshotAdapterResponse(size_bytes=1)

    async def restore(self, run_id: str, key: str):
        self._reach()
        await self._frozen("restore")
        if key not in self.store:
            raise NotFound(f"checkpoint {key} not found on this trainer")
        self.log.append(("restore", run_id, key))
        self.adapters[run_id] = list(self.store[key][1])
        return trainer_pb2.RestoreAdapterResponse()

    async def delete_checkpoint(self, key: str) -> int:
        self._reach()
        self.log.append(("delete", key))
        return 1 if self.store.pop(key, None) else 0

    async def run_cycle(self, request: trainer_pb2.CycleRequest) -> trainer_pb2.CycleResponse:
        self.calls += 1
        self._reach()
        await asyncio.sleep(self.delay)
        if self.gate is not None and ("run_cycle" in self.frozen_in or not self.frozen_in):
            await self._at_gate()
        response = trainer_pb2.CycleResponse()
        self.log.append(("cycle", [(item.training_run_id, item.seq_id) for item in [*request.forward_backward, *request.optim_step]]))
        for item in [*request.forward_backward, *request.optim_step]:
            key = (item.training_run_id, item.seq_id)
            if not self._missing(item.training_run_id) and not self._applied(*key):
                self.applied.append(key)
                self.answers[key] = float(item.seq_id)
                if self.adapters is not None:
                    self.adapters[item.training_run_id].append(("step" if item in request.optim_step else "fb", item.seq_id))
        for items, answers, statuses, name in [(request.forward_backward, response.forward_backward, response.forward_backward_status,
                                                "loss:sum"), (request.optim_step, response.optim_step, response.optim_step_status,
                                                              "step:max")]:
            for item in items:
                error = self._missing(item.training_run_id)
                if error is None:
                    answers.add(metrics={name: self.answers[(item.training_run_id, item.seq_id)]})
                    statuses.add()
                else:
                    answers.add()
                    statuses.add(code=status_number(error), message=error.message)
        if self.unreachable_for > 0:
            self.unreachable_for -= 1
            raise Unavailable("trainer fake-trainer:1 did not answer (UNAVAILABLE): connection reset")
        return response


class FakeBackends:
    def __init__(self, trainer: FakeTrainer, *more: FakeTrainer, placement: dict[str, FakeTrainer] | None = None):
        self.trainer = trainer
        self.trainers = [trainer, *more]
        self.placement = placement or {}   # run id -> its trainer (default: the first; None: one not reached)
        self.placements: dict[str, str] = {run: t.address for run, t in self.placement.items() if t is not None}
        self.down: set[str] = set()
        self.samplers = []
        self.ready = True  # connected (app.py waits for it with a registry)

    async def connect(self):
        return None

    async def wait_ready(self):
        return None

    async def settled(self):  # static workers: nothing to learn
        return None

    async def served(self, role, base_model):
        return None  # the fixed trainers are all here; trainer_for answers an unknown model

    async def wait_for_new_trainer(self):
        await asyncio.Event().wait()  # the trainers are fixed here

    async def close(self):
        return None

    def model_names(self):
        return [MODEL]

    def remember_placement(self, run_id, address):
        pass

    moved_off = Backends.moved_off

    def mark_down(self, address):
        self.down.add(address)

    def mark_up(self, address):
        self.down.discard(address)

    def trainer_for(self, base_model, run_id):
        if base_model != MODEL:
            raise NotFound(f"no trainer serves base model {base_model!r}")
        if run_id in self.placements:
            return next(t for t in self.trainers if t.address == self.placements[run_id])
        trainer = self.placement.get(run_id, self.trainer)
        if trainer is None:  # placed on a trainer that is not configured (any more)
            raise Unavailable(f"training run {run_id} lives on trainer gone:1, which this scheduler does not reach; retry")
        return trainer


    def place(self, base_model, among=None, counts=None):
        candidates = among or [t for t in self.trainers if t.address not in self.down]
        held = {t.address: (counts.get(t.address, 0) if counts is not None else
                            sum(1 for a in self.placements.values() if a == t.address)) for t in candidates}
        return next(t for t in candidates if t.address == min(held, key=lambda a: (held[a], a)))


def settings(**overrides) -> SchedulerSettings:
    return SchedulerSettings(database_url="sqlite://", bind="127.0.0.1:0", **overrides)


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
