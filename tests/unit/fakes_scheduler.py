"""In-process fakes for the scheduler's collaborators: a store in memory and a trainer that applies
each (run, seq) once and answers resent seqs from memory, as the real trainer does."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from temper.common.errors import TemperError, Unauthenticated, NotFound, Unavailable, status_number
from temper.scheduler.admission import Admission
from temper.scheduler.loop import SchedulerLoop
from temper.scheduler.runs import RunRegistry
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

    def _check(self):
        if self.down:
            raise Unavailable("the database is unavailable (fake); retry")

    def add_run(self, run_id: str, tenant: str) -> None:
        self.runs[run_id] = SimpleNamespace(id=run_id, session_id=f"s-{tenant}", base_model=MODEL, next_seq_id=1, trainer=None)
        self.tenants[run_id] = tenant

    def set_tenant_weights(self, weights):
        self._check()

    def tenant_weights(self):
        self._check()
        return {}

    def load_run(self, run_id, kinds):
        self._check()
        if run_id not in self.runs:
            raise NotFound(f"training run {run_id!r} not found")
        return self.runs[run_id], self.tenants[run_id], False

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

    def tenant_limits(self, tenant):
        self._check()
        return self.limits.get(tenant, {})

    def get_request(self, run_id, seq_id):
        self._check()
        return self.requests.get((run_id, seq_id))

    def add_request(self, run_id, seq_id, kind, sha, status, tokens, error=None):
        time.sleep(self.add_delay)
        self._check()
        with self.lock:
            self.requests[(run_id, seq_id)] = SimpleNamespace(training_run_id=run_id, seq_id=seq_id, kind=kind, payload_sha256=sha,
                                                              status=status, error=error, result=None)

    def mark_running(self, keys):
        self._check()
        for key in keys:
            self.requests[key].status = "running"

    def finish_requests(self, outcomes, tokens, steps, next_seq, window=0):
        self._check()
        for run_id, seq_id, status, error, result in outcomes:
            record = self.requests[(run_id, seq_id)]
            record.status, record.error, record.result = status, error, result

    def statuses(self, run_id: str) -> dict[int, str]:
        return {seq: r.status for (run, seq), r in sorted(self.requests.items()) if run == run_id}


@dataclass
class FakeTrainer:
    """Answers fb items with loss:sum = seq; remembers applied seqs per run (and answers them again).
    Runs in ``refuse`` are refused per item, as the real trainer does: their items answer the error's
    status and nothing of them is applied; the other items of the cycle run."""

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

    async def run_cycle(self, request: trainer_pb2.CycleRequest) -> trainer_pb2.CycleResponse:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        response = trainer_pb2.CycleResponse()
        for item in [*request.forward_backward, *request.optim_step]:
            key = (item.training_run_id, item.seq_id)
            if key not in self.answers and item.training_run_id not in self.refuse:
                self.applied.append(key)
                self.answers[key] = float(item.seq_id)
        for items, answers, statuses, name in [(request.forward_backward, response.forward_backward, response.forward_backward_status,
                                                "loss:sum"), (request.optim_step, response.optim_step, response.optim_step_status,
                                                              "step:max")]:
            for item in items:
                error = self.refuse.get(item.training_run_id)
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
        self.samplers = []

    async def connect(self):
        return None

    async def wait_ready(self):
        return None

    async def close(self):
        return None

    def model_names(self):
        return [MODEL]

    def remember_placement(self, run_id, address):
        pass

    def trainer_for(self, base_model, run_id):
        if base_model != MODEL:
            raise NotFound(f"no trainer serves base model {base_model!r}")
        trainer = self.placement.get(run_id, self.trainer)
        if trainer is None:  # placed on a trainer that is not configured (any more)
            raise Unavailable(f"training run {run_id} lives on trainer gone:1, which this scheduler does not reach; retry")
        return trainer


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
