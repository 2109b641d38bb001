"""The scheduler loop: one lane per trainer (``lanes.py``), all at once; each plans cycles from its
own runs' ready work and runs them here:

    mark the work running, send the passes and optim steps in one RunCycle, then each barrier
    (save / load) on its own; record each item's outcome; answer the callers

Outcomes are told honestly, per item: work the trainer refused is answered failed with the
trainer's code and message (the trainer refuses runs one by one, before it touches them; the
other runs' items in the cycle are done); work whose trainer did not answer is resent for a while
(the trainer answers a seq it applied from memory) and then answered UNAVAILABLE, so the client's
resend learns the true outcome; a database outage delays recording and answers, never loses them.
A run whose trainer lost its adapter (it restarted) or died is restored, and its work held until
then: ``recovery.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from temper.common.checkpoints import CheckpointPath, parse_path
from temper.common.cycles import ITEMS_PER_RUN_PER_CYCLE
from temper.common.errors import Abandoned, AlreadyExists, FailedPrecondition, NotFound, TemperError, Unavailable
from temper.common.retry import retry
from temper.scheduler import metrics
from temper.scheduler.cluster.ownership import LaneOwner, SoleOwner
from temper.scheduler.planning.admission import Admission
from temper.scheduler.workers.backends import Backends, TrainerHandle
from temper.scheduler.planning.checkpoint_removal import remove_checkpoint
from temper.scheduler.planning.cycles import build_cycle, cycle_outcomes
from temper.scheduler.planning.group_commit import Finish, FinishWriter, Running
from temper.scheduler.planning.inflight import Target
from temper.scheduler.planning.lanes import Lane
from temper.scheduler.planning.policy import CyclePlan, FairShare
from temper.scheduler.planning.recovery import Recovery, adapter_missing
from temper.scheduler.planning.records import metric_rows, stamp
from temper.scheduler.planning.runs import RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.db.audit import Actor
from temper.scheduler.db.views import KIND_NAMES, checkpoint_message
from temper.scheduler.tenancy.quotas import check_hard_limit
from temper.scheduler.planning.work import Work, WorkKind
from temper.v1 import service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)


class SchedulerLoop:
    def __init__(self, admission: Admission, backends: Backends, store, runs: RunRegistry, settings: SchedulerSettings,
                 share: FairShare | None = None):
        self.admission = admission
        self.backends = backends
        self.store = store
        self.runs = runs
        self.settings = settings
        self.share = share or FairShare()
        self.cycles = 0
        self.recovery = Recovery(self)
        self.finishes = FinishWriter(store, settings.durable_results_per_run)
        # run id -> the trainer its planned work is on now: a run moved meanwhile (fail-over) waits for that
        # work's outcome (answered, or held) before its new trainer's lane plans more of it (lanes.py)
        self.in_flight: dict[str, TrainerHandle] = {}
        self.ownership: LaneOwner = SoleOwner()  # replicas: cluster.ownership.LaneOwnership (set by the app)

    async def run_forever(self) -> None:
        """The lanes, one per trainer, concurrently. One that dies takes the others with it and this
        raises: app.py then answers the waiting calls UNAVAILABLE and exits for a restart."""
        await self._trainers_connected()
        started: set[int] = set()
        async with asyncio.TaskGroup() as group:
            while True:  # a trainer that joins later (it registered: membership.py) gets its lane then
                for trainer in [t for t in self.backends.trainers if id(t) not in started]:
                    started.add(id(trainer))
                    lane = Lane(self, trainer, FairShare(weights=self.share.weights, quantum=self.share.quantum))
                    group.create_task(lane.run_forever(), name=f"lane {trainer.address}")
                await self.backends.wait_for_new_trainer()

    async def _trainers_connected(self) -> None:
        while True:
            try:
                return await self.backends.wait_ready()
            except Unavailable:
                continue  # still connecting: that takes as long as it takes

    async def run_cycle(self, trainer: TrainerHandle, plan: CyclePlan) -> None:
        """A planned cycle on ``trainer`` (every run of it is placed there)."""
        self.cycles += 1
        number, started, outcome = self.cycles, time.monotonic(), "ok"
        in_pass = plan.passes + plan.optim_steps
        runs = {w.run_id for w in plan.all_work()}
        self.in_flight.update(dict.fromkeys(runs, trainer))
        try:
            if in_pass:
                # Recorded before anything reaches a trainer: after a crash, "running" rows (queued at or
                # below their run's dispatched watermark, request_log.py) are the ones that may have been applied.
                await self._mark_running([w for w in in_pass if not w.marked])
                stamp(in_pass, trainer.address, number)
                outcome = await self._cycle_on(trainer, plan.passes, plan.optim_steps, plan)
            for work in plan.barriers:
                stamp([work], trainer.address, number)
                outcome = _worse(outcome, await self._barrier(trainer, work, plan))
            await self.recovery.after_cycle(trainer, plan)
        except Exception:
            log.error("cycle %d on trainer %s stopped the loop; plan: %s", number, trainer.address, describe(plan))
            raise
        finally:
            for run_id in runs:
                if self.in_flight.get(run_id) is trainer:
                    del self.in_flight[run_id]
            if any(self.backends.moved_off(r, trainer) for r in runs):
                self.admission.wake.set()  # moved meanwhile: their new trainer's lane may plan them now
            elapsed = time.monotonic() - started
            tokens = sum(w.num_tokens for w in plan.passes)
            metrics.CYCLES.labels(outcome).inc()
            metrics.CYCLE_SECONDS.observe(elapsed)
            metrics.CYCLE_TOKENS.observe(tokens)
        log.debug("cycle %d on trainer %s %s: %d runs, %d tenants, %d tokens, %d passes, %d steps, %d barriers, %.0f ms",
                 number, trainer.address, outcome,
                 len({w.run_id for w in plan.all_work()}), len({w.tenant for w in plan.all_work()}), tokens, len(plan.passes),
                 len(plan.optim_steps), len(plan.barriers), elapsed * 1000)

    def trainer_of_run(self, run_id: str) -> TrainerHandle | None:
        """The trainer a run is placed on (backends.py: stable per run), hence its lane; None: a run this
        process has not looked up (no work of it can be queued)."""
        info = self.runs.known(run_id)
        return self.backends.trainer_for(info.base_model, run_id) if info is not None else None

    async def _cycle_on(self, trainer: TrainerHandle, passes: list[Work], steps: list[Work], plan: CyclePlan) -> str:
        request = build_cycle(passes, steps)
        works = passes + steps

        async def call(resent: bool) -> list:
            return cycle_outcomes(await trainer.run_cycle(request), len(passes), len(steps))

        outcomes = await self._call_trainer(trainer, call, works, plan)
        if isinstance(outcomes, str):
            return outcomes
        count = len(works)
        works, outcomes = self.recovery.lost(trainer, works, outcomes)  # held until their runs are restored
        outcomes = [_adapter_lost(trainer, w, o) for w, o in zip(works, outcomes)]
        failed = [(w, o) for w, o in zip(works, outcomes) if isinstance(o, TemperError)]
        for work, exc in failed:
            log.warning("trainer %s refused %s(%s#%d, tenant %s): %s: %s", trainer.address, work.kind.value, work.run_id,
                        work.seq_id, work.tenant, exc.code.name, exc.message)
        if works:
            await self.finish(works, outcomes)
        return "failed" if failed else "held" if len(works) < count else "ok"

    async def _barrier(self, trainer: TrainerHandle, work: Work, plan: CyclePlan) -> str:
        if self.backends.moved_off(work.run_id, trainer):  # moved while the passes ran
            self.admission.hold([work])
            return "held"
        await self._mark_running([work])
        apply = self._save if work.kind is WorkKind.SAVE_WEIGHTS else self._load
        outcome = await self._call_trainer(trainer, lambda resent: apply(trainer, work, resent or work.resent), [work], plan)
        if isinstance(outcome, str):
            return outcome
        await self.finish([work], [outcome])
        return "ok"

    async def _call_trainer(self, trainer: TrainerHandle, call, works: list[Work], plan: CyclePlan):
        """The trainer's answer; or, having answered the callers, "failed" (the trainer refused: nothing
        was applied) or "unknown" (no answer within dispatch_retry_seconds: UNAVAILABLE, resend); or
        "held": the trainer lost the runs' adapters, or stayed silent while another trainer of the
        model answers, and the work waits for its runs to be restored (recovery.py)."""
        resent = False

        def resending(exc, pause) -> None:
            nonlocal resent
            resent = True

        try:
            return await retry(lambda: call(resent), seconds=self.settings.dispatch_retry_seconds,
                               between=resending, what="no answer from the trainer, resending")
        except Abandoned:  # their runs moved to another trainer (fail_over): they run there once restored
            self.admission.hold(works)
            return "held"
        except Unavailable as exc:  # silent for dispatch_retry_seconds
            if await self.recovery.fail_over(trainer, {w.run_id for w in works}):
                self.admission.hold(works)  # their runs moved to another trainer: they run there once restored
                return "held"
            log.warning("no answer from the trainer for %d requests (%s); answered UNAVAILABLE; plan: %s",
                        len(works), exc.message, describe(plan))
            self.admission.release(works, Unavailable(f"{exc.message}; whether it was applied is not known yet: resend it"))
            return "unknown"
        except TemperError as exc:
            if self.recovery.enabled and all(adapter_missing(exc, w.run_id) for w in works):
                self.recovery.lost(trainer, works, [exc] * len(works))
                return "held"
            log.warning("trainer refused %d requests: %s: %s; plan: %s", len(works), exc.code.name, exc.message, describe(plan))
            await self.finish(works, [exc] * len(works))
            return "failed"

    def abandon(self, trainer: TrainerHandle) -> None:
        """Stop waiting for every call on ``trainer`` (its runs were moved away: recovery.fail_over):
        cycles, saves, loads, snapshots, restores alike raise Abandoned in their callers
        (workers/abandon.py). Whatever it applies there later is on a copy nobody uses again."""
        trainer.abandon()

    async def _save(self, trainer: TrainerHandle, work: Work, resent: bool) -> service_pb2.SaveWeightsResponse:
        request = work.request
        path = CheckpointPath(work.run_id, request.kind, request.name)
        ephemeral = request.ephemeral or request.inflight  # in-flight versions are collected when idle, as snapshots
        limit = 0 if ephemeral else self.admission.quotas.cached(work.tenant).max_storage_bytes
        if limit:  # snapshots are collected by themselves; named saves are what fills storage
            async with self.admission.quotas.storage_lock(work.tenant):  # measured to written: no other save of the tenant between
                await self._within_storage(trainer, work, path, limit)
                row = await self._write_checkpoint(trainer, work, path, resent)
        else:
            row = await self._write_checkpoint(trainer, work, path, resent)
        run = self.runs.known(work.run_id)
        resident = self.admission.quotas.cached(work.tenant).max_resident_adapters
        weights = None
        if request.inflight:
            # durable now (row and target in one transaction): answered at once, the samplers load it meanwhile
            target = Target(work.run_id, row.inflight_version, row.path)
            self.runs.inflight.advance(target)
            self.runs.inflight.spread(self.backends, trainer, run.base_model, target, work.tenant, resident)
            weights = target.weights()
        elif request.kind == types_pb2.CHECKPOINT_KIND_SAMPLER:
            weights = types_pb2.WeightsVersion(path=row.path, version=0)
            # Pushed now so a sampling client starts without waiting; if the sampler is down, the first
            # sampling client on this checkpoint pushes it instead.
            try:
                sampler = self.backends.sampler_for(run.base_model)
                await self.backends.push_checkpoint(trainer, sampler, path.key, tenant=work.tenant, max_resident=resident)
            except TemperError as exc:
                log.warning("could not push %s to a sampler now: %s", path.key, exc.message)
        return service_pb2.SaveWeightsResponse(checkpoint=checkpoint_message(row, run.row), weights=weights)

    async def _within_storage(self, trainer: TrainerHandle, work: Work, path: CheckpointPath, limit: int) -> None:
        """ResourceExhausted, before anything is written or removed, if the save would take the tenant's
        checkpoints over ``limit``: its size measured by the trainer (what it would write), an
        overwritten checkpoint's bytes counted as freed."""
        request, freed = work.request, 0
        if request.overwrite:
            try:
                freed = (await self.persist(self.store.get_checkpoint, str(path))).size_bytes
            except NotFound:
                pass
        measured = await trainer.call("SaveAdapter", trainer_pb2.SaveAdapterRequest(
            training_run_id=work.run_id, checkpoint_key=path.key, measure_only=True,
            include_optimizer=request.kind == types_pb2.CHECKPOINT_KIND_TRAINING))
        used = await self.persist(self.store.storage_bytes, work.tenant)
        check_hard_limit("max_storage_bytes", limit, used - freed, adding=measured.size_bytes)

    async def _write_checkpoint(self, trainer: TrainerHandle, work: Work, path: CheckpointPath, resent: bool):
        """The save's files on the trainer (an overwritten checkpoint removed first), then its row."""
        request = work.request
        if request.overwrite:
            await self._remove_existing(str(path))
        try:
            saved = await trainer.call("SaveAdapter", trainer_pb2.SaveAdapterRequest(
                training_run_id=work.run_id, checkpoint_key=path.key,
                include_optimizer=request.kind == types_pb2.CHECKPOINT_KIND_TRAINING))
            size = saved.size_bytes
        except AlreadyExists:
            if not resent:
                raise
            # The first attempt wrote it (its answer was lost); nothing of the run has run since.
            size = sum([len(chunk.data) async for chunk in trainer.read_checkpoint(path.key)])
        if request.inflight:  # the row and the run's move to it, in one transaction (db/inflight.py)
            return await self.persist(self.store.add_inflight_checkpoint, work.run_id, request.name, str(path), size,
                                      dict(request.user_metadata))
        actor = Actor("api" if work.key_prefix else "scheduler", work.key_prefix, work.tenant)
        return await self.persist(self.store.add_or_get_checkpoint, work.run_id, KIND_NAMES[request.kind], request.name, str(path),
                                  size, request.ephemeral, request.ttl_seconds, dict(request.user_metadata), actor)

    async def _remove_existing(self, path: str) -> None:
        """An overwriting save: the checkpoint of that name goes first (files, sampler copies, row)."""
        try:
            row = await asyncio.to_thread(self.store.get_checkpoint, path)
        except NotFound:
            return
        await remove_checkpoint(self.store, self.backends, self.runs, row)

    async def _load(self, trainer: TrainerHandle, work: Work, resent: bool) -> service_pb2.LoadWeightsResponse:
        request = work.request
        await trainer.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(
            training_run_id=work.run_id, checkpoint_key=parse_path(request.path).key, with_optimizer=request.with_optimizer))
        return service_pb2.LoadWeightsResponse(path=request.path)

    async def finish(self, works: list[Work], outcomes: list) -> None:
        """Record each work's outcome (its answer, or the TemperError it failed with), the counters and
        the answers, kept for retries after a restart, in one transaction (group-committed with other
        lanes' cycles: ``FinishWriter``); then answer the callers. A database outage delays this; it
        never turns into a wrong answer."""
        rows, tokens, steps, next_seq = [], defaultdict(int), defaultdict(int), {}
        for w, outcome in zip(works, outcomes):
            self.recovery.finished(w, outcome)
            failed = isinstance(outcome, TemperError)
            rows.append((w.run_id, w.seq_id, "failed" if failed else "done", outcome.message if failed else None,
                         None if failed else outcome.SerializeToString()))
            next_seq[w.run_id] = max(next_seq.get(w.run_id, 0), w.seq_id + 1)
            if not failed and w.kind is WorkKind.FORWARD_BACKWARD:
                tokens[w.run_id] += w.num_tokens
            if not failed and w.kind is WorkKind.OPTIM_STEP:
                steps[w.run_id] += 1
        ahead = self._next_passes(next_seq)
        finish = Finish(rows, tokens, steps, next_seq, metric_rows(works, outcomes), [(w.run_id, w.seq_id) for w in ahead])
        # with the outcomes of the other lanes' cycles that end meanwhile, in one transaction
        await retry(lambda: self.finishes.add(finish), seconds=None, first_delay=0.1,
                    what="the database is unavailable, retrying finish_requests")
        for work in ahead:
            work.marked = True
        for w, outcome in zip(works, outcomes):
            if isinstance(outcome, TemperError):
                w.fail(outcome)
            else:
                if w.kind is WorkKind.FORWARD_BACKWARD:
                    metrics.TOKENS_TRAINED.labels(w.tenant).inc(w.num_tokens)
                w.resolve(outcome)

    def _next_passes(self, runs) -> list[Work]:
        """The queued work that most likely makes ``runs``' next cycle (per run, as policy.py takes it:
        passes up to a cycle's items, then one optim step; a barrier ends it): marked running with
        this cycle's outcomes (their runs' watermarks move in the same run row update as the counters),
        so the next cycle goes to its trainer without a transaction of its own.
        Marked early, a request is "running" a little before it is sent: after a crash it is treated
        as maybe applied (its resend is answered from the trainer's memory or applied once), never
        the other way round."""
        ahead = []
        for run_id in runs:
            queue = self.admission.queues.get(run_id)
            for work in queue.ready()[:ITEMS_PER_RUN_PER_CYCLE] if queue is not None else ():
                if work.kind.is_barrier:
                    break
                if not work.marked:
                    ahead.append(work)
                if work.kind is WorkKind.OPTIM_STEP:
                    break
        return ahead

    async def _mark_running(self, works: list[Work]) -> None:
        """Store.mark_running, in the request writer's next group commit (with the rows admitted
        meanwhile: no transaction or thread hop of its own); retried while the database is
        unavailable, as persist does."""
        if not works:
            return
        running = Running([(w.run_id, w.seq_id) for w in works])
        return await retry(lambda: self.admission.writer.add(running), seconds=None, first_delay=0.1,
                           what="the database is unavailable, retrying mark_running")

    async def persist(self, fn, *args):
        """A store call, retried for as long as the database is unavailable (the loop can do nothing
        else meanwhile: every cycle starts and ends with a write)."""
        return await retry(lambda: asyncio.to_thread(fn, *args), seconds=None, first_delay=0.1,
                           what=f"the database is unavailable, retrying {getattr(fn, '__name__', 'the write')}")


def _adapter_lost(trainer: TrainerHandle, work: Work, outcome):
    """A run the scheduler knows whose adapter its trainer does not have (the trainer restarted and
    lost it) while recovery is off: a precondition of the run, not an unknown id. Never answered
    from a fresh adapter. (With recovery on, such work is held and the run restored instead.)"""
    if isinstance(outcome, NotFound):
        return FailedPrecondition(f"the adapter of {work.run_id} is gone from trainer {trainer.address} (it restarted?); the "
                                  f"run's state since its last saved checkpoint is lost: load that checkpoint into a new run "
                                  f"({outcome.message})")
    return outcome


def _worse(a: str, b: str) -> str:
    order = ("ok", "held", "failed", "unknown")
    return max(a, b, key=order.index)


def describe(plan: CyclePlan) -> str:
    """The plan, one entry per work item, for logs of a failed cycle."""
    return ", ".join(f"{w.kind.value}({w.run_id}#{w.seq_id}, {w.num_tokens} tok, tenant {w.tenant})" for w in plan.all_work())
