"""Trainer recovery: a trainer's death loses nothing acknowledged (``recovery = "snapshot_replay"``).

Three parts, around the lanes (``lanes.py``) and the loop (``loop.py``):

- **The log.** Admission stores every state-changing request (forward_backward, optim_step,
  load_weights) serialized in its ``requests`` row (``payload``).
- **Snapshots.** After a run's optim step, every ``snapshot_every_steps`` steps (or
  ``snapshot_every_seconds``), and after every load, its lane asks the run's trainer for an exact
  snapshot of the adapter (``SnapshotAdapter``, ``<run>/snapshots/<seq>`` in the trainers' shared
  checkpoint store), records it on the run's row and clears the payloads it covers in one
  transaction, then deletes the previous snapshot's files. A run that has none yet is restored from
  a fresh adapter of its LoRA config and seed (creation is deterministic given the seed; a run
  created without a seed is snapshotted at creation instead: ``servicer.py``).
- **Restore.** A trainer that answers NotFound for a run's adapter (it restarted without it), or
  that stays unreachable for ``dispatch_retry_seconds`` while another trainer of its model answers
  (its runs are then moved there, durably: ``training_runs.trainer``), marks the run *pending*: the
  work that was on the trainer is held, not failed (``Admission.hold``), and before the run's next
  cycle its lane rebuilds the adapter (RestoreAdapter from the snapshot, or CreateAdapter) and
  replays, in seq order, the done requests after the snapshot up to the last one finished. Then the
  held work runs. Requests the trainer refused (failed) or that change nothing (forward, save) are
  not replayed. A run whose log has a hole (a payload missing: logged before recovery was on) or
  whose snapshot cannot be read is refused FAILED_PRECONDITION naming its last durable seq.

LoRA dropout draws from the trainer's RNG, which no snapshot holds: only runs without dropout are
restored bit for bit (replayed cycles are batched alone, not with their original neighbours, so
the weights agree to float rounding: ~1e-7).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import defaultdict
from typing import Any, Protocol

from temper.common.checkpoints import parse_path
from temper.common.errors import Abandoned, AlreadyExists, FailedPrecondition, NotFound, TemperError, Unavailable
from temper.common.retry import retry
from temper.scheduler import metrics
from temper.scheduler.planning.admission import Admission
from temper.scheduler.planning.cycles import build_cycle, cycle_outcomes
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.workers.backends import Backends, TrainerHandle
from temper.scheduler.workers.events import cluster_event
from temper.scheduler.db.request_log import LoggedRequest
from temper.scheduler.planning.policy import CyclePlan
from temper.scheduler.planning.work import Work, WorkKind
from temper.v1 import service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)
REPLAYED = {WorkKind.FORWARD_BACKWARD.value, WorkKind.OPTIM_STEP.value, WorkKind.LOAD_WEIGHTS.value}
MAX_RESTORES = 3        # restores of one run in a row whose work still finds no adapter: then the run is refused
WATCH_SECONDS = 2.0     # how often a trainer marked down is asked whether it is back


def adapter_missing(exc: BaseException, run_id: str) -> bool:
    """The trainer has no adapter of ``run_id`` (AdapterHost.get's NotFound), as opposed to, say, a
    missing checkpoint."""
    return isinstance(exc, NotFound) and f"the adapter of run {run_id} " in exc.message


def snapshot_key(run_id: str, seq: int) -> str:
    """A key of its own for every snapshot taken: one a trainer finishes after the call was given up
    (and then deletes: trainer servicer) is never the key of a snapshot taken again and recorded."""
    return f"{run_id}/snapshots/{seq}-{attempt_token()}"


def attempt_token() -> str:
    return secrets.token_hex(4)


class RecoveryHost(Protocol):
    """What recovery needs of the loop that owns it (SchedulerLoop): the loop builds on recovery, not
    the other way round."""
    admission: Admission
    backends: Backends
    store: Any
    runs: RunRegistry
    settings: SchedulerSettings

    async def persist(self, fn, *args): ...
    async def finish(self, works: list[Work], outcomes: list) -> None: ...
    def abandon(self, trainer: TrainerHandle) -> None: ...


class Recovery:
    def __init__(self, loop: RecoveryHost):
        self.loop = loop
        self.pending: dict[str, str] = {}                        # run -> why its adapter must be rebuilt first
        self.broken: dict[str, FailedPrecondition] = {}          # runs that cannot be restored exactly
        self.restores: dict[str, int] = defaultdict(int)         # restores since the run's work last went through
        self._checked: set[str] = set()                          # runs whose training_runs.restoring was looked at
        self.steps_since: dict[str, int] = defaultdict(int)      # optim steps since the run's last snapshot
        self.snapshot_at: dict[str, float] = {}                  # monotonic time of the run's last snapshot
        self.finished_seq: dict[str, int] = {}                   # the run's last finished seq (this process)
        self.due: set[str] = set()                               # runs to snapshot after their cycle
        self.moved: dict[str, set[str]] = defaultdict(set)      # trainer address -> runs moved away from it
        self._watchers: dict[str, asyncio.Task] = {}

    @property
    def enabled(self) -> bool:
        return self.loop.settings.recovery != "off"

    # ---- the loop's hooks ------------------------------------------------------------------------

    def lost(self, trainer: TrainerHandle, works: list[Work], outcomes: list) -> tuple[list[Work], list]:
        """A cycle's works and outcomes without those whose adapter the trainer does not have: these
        are held (queued again) and their runs marked pending."""
        if not self.enabled:
            return works, outcomes
        kept, held = [], []
        for work, outcome in zip(works, outcomes):
            if adapter_missing(outcome, work.run_id):
                held.append(work)
                self._mark(work.run_id, f"trainer {trainer.address} lost its adapter (it restarted?)")
            else:
                kept.append((work, outcome))
        if held:
            self.loop.admission.hold(held)
        return [w for w, _ in kept], [o for _, o in kept]

    def finished(self, work: Work, outcome) -> None:
        """A work's recorded outcome (SchedulerLoop.finish): counts steps toward the next snapshot."""
        if not self.enabled or isinstance(outcome, TemperError):
            return
        self.restores.pop(work.run_id, None)
        self.finished_seq[work.run_id] = max(self.finished_seq.get(work.run_id, 0), work.seq_id)
        if work.kind is WorkKind.OPTIM_STEP:
            self.steps_since[work.run_id] += 1
            every, seconds = self.loop.settings.snapshot_every_steps, self.loop.settings.snapshot_every_seconds
            since = time.monotonic() - self.snapshot_at.get(work.run_id, time.monotonic())
            if self.steps_since[work.run_id] >= every or (seconds > 0 and since >= seconds):
                self.due.add(work.run_id)
        elif work.kind is WorkKind.LOAD_WEIGHTS:
            self.due.add(work.run_id)  # the loaded checkpoint may be deleted later: the snapshot outlives it

    async def after_cycle(self, trainer: TrainerHandle, plan: CyclePlan) -> None:
        """Snapshot the plan's runs that are due (their cycle's answers have already gone out)."""
        for run_id in [r for r in dict.fromkeys(w.run_id for w in plan.all_work()) if r in self.due]:
            self.due.discard(run_id)
            if run_id not in self.pending and not self.loop.backends.moved_off(run_id, trainer):  # its copy here is stale
                await self.snapshot(trainer, run_id, self.finished_seq[run_id])

    async def snapshot(self, trainer: TrainerHandle, run_id: str, seq: int) -> bool:
        """Snapshot the run's adapter as of ``seq`` and record it; best effort (False: not taken)."""
        key, started = snapshot_key(run_id, seq), time.monotonic()
        try:
            try:
                taken = await trainer.snapshot(run_id, key)
            except AlreadyExists:  # left by a snapshot never recorded (the scheduler stopped): taken again
                await trainer.delete_checkpoint(key)
                taken = await trainer.snapshot(run_id, key)
        except TemperError as exc:
            if adapter_missing(exc, run_id):
                self._mark(run_id, f"trainer {trainer.address} lost its adapter (it restarted?)")
            log.warning("no snapshot of %s at seq %d on trainer %s: %s", run_id, seq, trainer.address, exc.message)
            return False
        previous = await self.loop.persist(self.loop.store.record_snapshot, run_id, key, seq)
        self.steps_since[run_id], self.snapshot_at[run_id] = 0, time.monotonic()
        metrics.SNAPSHOT_SECONDS.observe(time.monotonic() - started)
        log.info("snapshot of %s at seq %d (%d bytes) on trainer %s in %.0f ms", run_id, seq, taken.size_bytes, trainer.address,
                 (time.monotonic() - started) * 1000)
        if previous:
            try:
                await trainer.delete_checkpoint(previous)
            except TemperError as exc:
                log.warning("could not delete %s's previous snapshot %s: %s", run_id, previous, exc.message)
        return True

    async def restore_before(self, trainer: TrainerHandle, plan: CyclePlan) -> bool:
        """Before a cycle: rebuild the adapters of the plan's pending runs on ``trainer``. True when
        anything was done (restored, moved, failed or released): the lane plans again."""
        if not self.enabled:
            return False
        runs = [r for r in dict.fromkeys(w.run_id for w in plan.all_work())
                if r in self.pending or r in self.broken or (r not in self._checked and self._interrupted(r))]
        if not runs:
            return False
        for run_id in runs:
            works = [w for w in plan.all_work() if w.run_id == run_id]
            try:
                await self._restore_reachable(trainer, run_id, works[0].seq_id - 1)
            except FailedPrecondition as exc:
                self.loop.admission.take(works)
                await self.loop.finish(works, [exc] * len(works))
            except Unavailable as exc:
                self.loop.admission.take(works)
                self.loop.admission.release(works, Unavailable(f"{exc.message}; nothing was applied: resend it"))
            except Abandoned:  # the trainer froze mid-restore and the run moved: its work waits, untaken, for its new trainer
                log.warning("restoring %s on trainer %s given up: the run moved to %s", run_id, trainer.address,
                            self.loop.backends.placements.get(run_id))
        return True

    async def fail_over(self, dead: TrainerHandle, run_ids) -> bool:
        """``dead`` has not answered for dispatch_retry_seconds. If another trainer of its model
        answers, every run placed on ``dead`` (and ``run_ids``) moves to the answering ones, placed
        by load and recorded, to be restored there; True. Else nothing changes; False."""
        if not self.enabled:
            return False
        backends = self.loop.backends
        others = [t for t in backends.trainers if t is not dead and t.info.base_model == dead.info.base_model]
        alive = [t for t in others if await t.ping()]
        if not alive:
            return False
        backends.mark_down(dead.address)
        # run_ids: runs of the caller's cycle with no placement recorded yet; one already moved elsewhere
        # (by an earlier fail-over) stays there: moving it again would restore it without what it did there
        moved = sorted({r for r, address in backends.placements.items() if address == dead.address}
                       | {r for r in run_ids if r not in backends.placements})
        for run_id in moved:
            target = backends.place(dead.info.base_model, among=alive)
            await self.loop.persist(self.loop.store.move_run, run_id, target.address)
            backends.placements[run_id] = target.address
            self.moved[dead.address].add(run_id)
            self._mark(run_id, f"trainer {dead.address} stopped answering; moved to {target.address}")
        log.warning("trainer %s does not answer: its %d runs move to %s", dead.address, len(moved), [t.address for t in alive])
        cluster_event("recovery", f"trainer {dead.address} does not answer: its {len(moved)} runs moved to "
                      f"{', '.join(t.address for t in alive)}", dead.address)
        self.loop.abandon(dead)  # a call still waiting there (a frozen trainer): its work is held for the new trainer
        if dead.address not in self._watchers:
            self._watchers[dead.address] = asyncio.create_task(self._watch(dead), name=f"watch {dead.address}")
        self.loop.admission.wake.set()
        return True

    def trainer_restarted(self, trainer: TrainerHandle) -> list[str]:
        """``trainer`` came back as a new process (it registered a new incarnation: membership.py), so
        the runs placed on it lost their adapters: each is restored before its next cycle instead of
        after a cycle answers NotFound. The runs marked."""
        if not self.enabled:
            return []
        runs = sorted(r for r, address in self.loop.backends.placements.items() if address == trainer.address)
        for run_id in runs:
            self._mark(run_id, f"trainer {trainer.address} restarted (a new incarnation registered)")
        return runs

    def forget(self, run_id: str) -> None:
        """Drop what this process knew of the run's recovery (its lane changed hands: handover.py)."""
        for table in (self.pending, self.broken, self.restores, self.steps_since, self.snapshot_at, self.finished_seq):
            table.pop(run_id, None)
        self._checked.discard(run_id)
        self.due.discard(run_id)

    # ---- restoring one run -------------------------------------------------------------------------

    def _interrupted(self, run_id: str) -> bool:
        """Whether an earlier scheduler process began restoring the run and died before the replay
        ended (training_runs.restoring): the adapter on its trainer may be half-built, so it is restored
        again. Asked once per run and process."""
        self._checked.add(run_id)
        info = self.loop.runs.known(run_id)
        if info is None or not info.row.restoring:
            return False
        self._mark(run_id, "an earlier scheduler process was restoring it when it stopped")
        return True

    def _mark(self, run_id: str, why: str) -> None:
        if run_id not in self.pending:
            metrics.RUNS_RESTORED.labels("lost").inc()
            cluster_event("failure", f"{run_id} must be restored: {why}", run_id=run_id)
        self.pending[run_id] = why

    async def _restore_reachable(self, trainer: TrainerHandle, run_id: str, upto: int) -> None:
        """restore(), resent while the trainer does not answer (as a cycle is); past
        dispatch_retry_seconds the run moves to another trainer if one answers, else Unavailable."""
        try:
            await retry(lambda: self.restore(trainer, run_id, upto), seconds=self.loop.settings.dispatch_retry_seconds,
                        what=f"restoring {run_id}")
        except Unavailable:
            if not await self.fail_over(trainer, [run_id]):
                raise

    async def restore(self, trainer: TrainerHandle, run_id: str, upto: int) -> None:
        """Rebuild the run's adapter on ``trainer`` as the requests up to seq ``upto`` left it: its
        snapshot (or a fresh adapter), then the done requests after it, replayed in seq order."""
        if run_id in self.broken:
            raise self.broken[run_id]
        started, persist, store = time.monotonic(), self.loop.persist, self.loop.store
        row = await persist(store.get_training_run, run_id)
        base = row.snapshot_seq if row.snapshot_key else 0
        replay = [r for r in await persist(store.logged_requests, run_id, base, upto) if r.status == "done" and r.kind in REPLAYED]
        missing = [r.seq_id for r in replay if r.payload is None]
        if missing:
            self._break(run_id, base, f"the request log has no payload of seq {missing[0]} (logged before recovery was on?)")
        if row.snapshot_key is None and row.seed is None:
            self._break(run_id, base, "it has no snapshot and no seed to create its adapter again")
        if self.restores[run_id] >= MAX_RESTORES:  # counted per completed restore: retries of an unreachable trainer are not
            self._break(run_id, base, f"it was restored {MAX_RESTORES} times and its adapter was lost again each time")
        await persist(store.set_restoring, run_id, True)  # until the replay ends (a scheduler dying meanwhile)
        try:
            if row.snapshot_key:
                await trainer.restore(run_id, row.snapshot_key)
            else:
                await self._fresh_adapter(trainer, row)
            for batch in _batches(replay, self.loop.settings.cycle_token_budget):
                await self._replay(trainer, run_id, batch, bool(row.deterministic))
        except (Unavailable, Abandoned):  # not the run's fault: restored again (here, or on the trainer it moved to)
            raise
        except TemperError as exc:  # the snapshot is unreadable, or a replayed request was refused
            if adapter_missing(exc, run_id):  # the trainer restarted mid-restore: the whole restore again
                raise Unavailable(f"trainer {trainer.address} lost {run_id}'s adapter while it was being restored") from None
            await self._drop(trainer, run_id)
            self._break(run_id, base, f"{type(exc).__name__}: {exc.message}")
        await persist(store.set_restoring, run_id, False)
        self.restores[run_id] += 1
        why = self.pending.pop(run_id, "")
        metrics.RUNS_RESTORED.labels("restored").inc()
        cluster_event("recovery", f"{run_id} restored on trainer {trainer.address} ({why})", trainer.address, run_id)
        metrics.RESTORE_SECONDS.observe(time.monotonic() - started)
        log.warning("restored %s on trainer %s (%s): %s, then %d requests replayed (seq %d-%d), in %.0f ms", run_id,
                    trainer.address, why, f"snapshot {row.snapshot_key}" if row.snapshot_key else "a fresh adapter",
                    len(replay), base + 1, upto, (time.monotonic() - started) * 1000)

    def _break(self, run_id: str, base: int, why: str):
        self.pending.pop(run_id, None)
        exc = self.broken[run_id] = FailedPrecondition(
            f"the adapter of {run_id} was lost with its trainer and cannot be restored exactly: {why}; its last durable "
            f"state is {'its snapshot after seq ' + str(base) if base else 'its creation'}; load a saved checkpoint into a new run")
        metrics.RUNS_RESTORED.labels("failed").inc()
        cluster_event("failure", f"{run_id} cannot be restored: {why}", run_id=run_id)
        log.error("%s", exc.message)
        raise exc

    async def _fresh_adapter(self, trainer: TrainerHandle, row) -> None:
        await self._drop(trainer, row.id)
        # the experts' rank the run was made with, asked for explicitly: a trainer whose default differs builds the same shape
        config = types_pb2.LoraConfig(rank=row.lora_rank, alpha=row.lora_alpha, dropout=row.lora_dropout, seed=row.seed,
                                      train_attn=row.train_attn, train_mlp=row.train_mlp, train_unembed=row.train_unembed,
                                      expert_rank=row.lora_expert_rank or 0)
        await trainer.call("CreateAdapter", trainer_pb2.CreateAdapterRequest(training_run_id=row.id, lora_config=config))

    @staticmethod
    async def _drop(trainer: TrainerHandle, run_id: str) -> None:
        try:
            await trainer.call("DropAdapter", trainer_pb2.DropAdapterRequest(training_run_id=run_id))
        except NotFound:
            pass
        except Unavailable as exc:
            log.warning("could not drop %s's adapter on trainer %s: %s", run_id, trainer.address, exc.message)

    async def _replay(self, trainer: TrainerHandle, run_id: str, batch: list[LoggedRequest], deterministic: bool) -> None:
        if batch[0].kind == WorkKind.LOAD_WEIGHTS.value:
            request = service_pb2.LoadWeightsRequest.FromString(batch[0].payload)
            await trainer.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(
                training_run_id=run_id, checkpoint_key=parse_path(request.path).key, with_optimizer=request.with_optimizer))
            return
        passes = [Work(run_id, r.seq_id, WorkKind.FORWARD_BACKWARD, service_pb2.ForwardBackwardRequest.FromString(r.payload))
                  for r in batch if r.kind == WorkKind.FORWARD_BACKWARD.value]
        steps = [Work(run_id, r.seq_id, WorkKind.OPTIM_STEP, service_pb2.OptimStepRequest.FromString(r.payload))
                 for r in batch if r.kind == WorkKind.OPTIM_STEP.value]
        for work in passes:  # replayed as it first ran: a deterministic run's passes replay bit for bit
            work.deterministic = deterministic
        outcomes = cycle_outcomes(await trainer.run_cycle(build_cycle(passes, steps)), len(passes), len(steps))
        for work, outcome in zip(passes + steps, outcomes):
            if isinstance(outcome, TemperError):
                raise type(outcome)(f"replaying seq {work.seq_id}: {outcome.message}")

    async def _watch(self, trainer: TrainerHandle) -> None:
        """A trainer marked down takes new runs again once it answers; the stale adapters of the runs
        moved away from it (if it was only frozen) are dropped there."""
        while not await trainer.ping():
            await asyncio.sleep(WATCH_SECONDS)
        for run_id in sorted(self.moved.pop(trainer.address, ())):
            if self.loop.backends.placements.get(run_id) != trainer.address:
                await self._drop(trainer, run_id)
        self.loop.backends.mark_up(trainer.address)
        self._watchers.pop(trainer.address, None)
        log.info("trainer %s answers again: new runs may be placed there", trainer.address)
        cluster_event("recovery", f"trainer {trainer.address} answers again", trainer.address)


def _batches(replay: list[LoggedRequest], token_budget: int) -> list[list[LoggedRequest]]:
    """The replay in cycles: passes up to and including the next optim step (within the token
    budget), and each load alone."""
    batches, current, tokens = [], [], 0
    for record in replay:
        if record.kind == WorkKind.LOAD_WEIGHTS.value or (record.kind == WorkKind.FORWARD_BACKWARD.value and current
                                                          and tokens + record.num_tokens > token_budget):
            if current:
                batches.append(current)
            current, tokens = [], 0
        if record.kind == WorkKind.LOAD_WEIGHTS.value:
            batches.append([record])
            continue
        current.append(record)
        tokens += record.num_tokens
        if record.kind == WorkKind.OPTIM_STEP.value:
            batches.append(current)
            current, tokens = [], 0
    if current:
        batches.append(current)
    return batches
