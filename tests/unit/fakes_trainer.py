"""In-process fakes of the scheduler's workers: a trainer that applies each (run, seq) once and answers
resent seqs from memory, as the real trainer does, and the Backends that place runs on such trainers.
(fakes_scheduler.py builds a scheduler over them.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from temper.common.errors import AlreadyExists, TemperError, NotFound, Unavailable, status_number
from temper.scheduler.workers.abandon import Calls
from temper.scheduler.workers.backends import Backends
from temper.v1 import trainer_pb2

MODEL = "fake-model"


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
