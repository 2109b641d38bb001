"""The scheduler loop: plan a cycle from the ready queues, run it on the trainers, answer futures.

    while True:
        wait until work arrives (or skip a run's missing seq that was waited for too long)
        while (plan := plan_cycle(ready work, budget)):
            take the planned work off its queues
            run the cycle's passes and optim steps (one trainer call per trainer)
            run each barrier (save / load) on its own
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict

from temper.common.checkpoints import KIND_DIRS, CheckpointPath, parse_path
from temper.common.errors import ResourceExhausted, TemperError
from temper.scheduler.backends import Backends, TrainerHandle, downstream
from temper.scheduler.db.store import Store
from temper.scheduler.policy import CyclePlan, FairShare, plan_cycle
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.work import RunQueue, Work, WorkKind
from temper.v1 import service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)
KIND_NAMES = {types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler", types_pb2.CHECKPOINT_KIND_TRAINING: "training"}


class SchedulerLoop:
    def __init__(self, backends: Backends, store: Store, settings: SchedulerSettings, share: FairShare | None = None):
        self.backends = backends
        self.store = store
        self.token_budget = settings.cycle_token_budget
        self.max_queued = settings.max_queued_requests
        self.cache_size = settings.result_cache_size
        self.gap_timeout = settings.seq_gap_timeout_seconds
        self.result_window = settings.durable_results_per_run
        self.queues: dict[str, RunQueue] = {}
        self.run_models: dict[str, str] = {}              # run id -> base model
        self.run_tenants: dict[str, str] = {}             # run id -> tenant (for fair share)
        self.share = share or FairShare()
        self.recent: OrderedDict[tuple[str, int], Work] = OrderedDict()  # answers retried (run, seq)
        self._wake = asyncio.Event()
        self.cycles = 0

    # ---- intake -------------------------------------------------------------------------------

    def register_run(self, run_id: str, base_model: str, next_seq_id: int, tenant: str = "default") -> None:
        self.run_models.setdefault(run_id, base_model)
        self.run_tenants.setdefault(run_id, tenant)
        self.queues.setdefault(run_id, RunQueue(run_id, next_seq_id))

    def known(self, run_id: str, seq_id: int) -> Work | None:
        queue = self.queues.get(run_id)
        if queue is not None and seq_id in queue.pending:
            return queue.pending[seq_id]
        return self.recent.get((run_id, seq_id))

    def next_seq_id(self, run_id: str) -> int | None:
        queue = self.queues.get(run_id)
        return queue.next_seq_id if queue is not None else None

    def check_capacity(self, run_id: str, seq_id: int) -> None:
        queue = self.queues[run_id]
        if seq_id == queue.next_seq_id and len(queue):
            return  # the request this run's queued work waits for is always admitted, or it would deadlock
        if sum(len(q) for q in self.queues.values()) >= self.max_queued:
            raise ResourceExhausted(f"the scheduler has {self.max_queued} queued requests; retry with backoff")

    def claim(self, work: Work) -> None:
        """Make ``work`` the answer for its (run, seq): a retry arriving from now on waits for it."""
        work.future = asyncio.get_running_loop().create_future()
        work.submitted_at = time.monotonic()
        self._remember(work)

    def enqueue(self, work: Work) -> None:
        """Queue claimed work; its turn comes by seq_id (rejected work only holds its place)."""
        self.queues[work.run_id].add(work)
        self._wake.set()

    def _remember(self, work: Work) -> None:
        self.recent[(work.run_id, work.seq_id)] = work
        while len(self.recent) > self.cache_size:
            self.recent.popitem(last=False)

    # ---- the loop -----------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            await self._wait_for_work()
            while plan := plan_cycle(self._ready(), self.token_budget, self.run_tenants, self.share):
                for work in plan.all_work():
                    self.queues[work.run_id].take(work)
                await self._run_cycle(plan)

    async def _wait_for_work(self) -> None:
        """Until work arrives or a run's missing seq has been waited for long enough (then skip it)."""
        gaps = [since for q in self.queues.values() if (since := q.gap_since()) is not None]
        timeout = max(0.0, min(gaps) + self.gap_timeout - time.monotonic()) if gaps and self.gap_timeout > 0 else None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()
        if self.gap_timeout > 0:
            now = time.monotonic()
            for queue in self.queues.values():
                since = queue.gap_since()
                if since is not None and now - since >= self.gap_timeout:
                    gap = queue.skip_gap()
                    log.warning("run %s: skipped seq %d-%d after waiting %.0f s for it", queue.run_id, gap.start, gap.stop - 1,
                                now - since)

    def skipped(self, run_id: str, seq_id: int) -> bool:
        queue = self.queues.get(run_id)
        return queue is not None and queue.was_skipped(seq_id)

    def _ready(self) -> dict[str, list[Work]]:
        ready = {run_id: q.ready() for run_id, q in self.queues.items()}
        # Oldest head first, so a run that has waited longest is served first.
        return dict(sorted(((r, w) for r, w in ready.items() if w), key=lambda item: item[1][0].submitted_at))

    async def _run_cycle(self, plan: CyclePlan) -> None:
        self.cycles += 1
        # Recorded before anything reaches a trainer: after a crash, "running" rows are the ones that
        # may have been applied. Passes and steps are re-sent safely (the trainer knows the seqs it
        # applied); barriers are marked as they go (see Store.recover_interrupted).
        in_pass = plan.passes + plan.optim_steps
        if in_pass and not await self._guarded(in_pass, self._mark_running(in_pass)):
            return
        by_trainer: dict[str, tuple[TrainerHandle, list[Work], list[Work]]] = {}
        for work in plan.passes + plan.optim_steps:
            trainer = self.backends.trainer_for(self.run_models[work.run_id], work.run_id)
            entry = by_trainer.setdefault(trainer.address, (trainer, [], []))
            entry[1 if work.kind.is_pass else 2].append(work)
        for trainer, passes, steps in by_trainer.values():
            await self._guarded(passes + steps, self._dispatch_cycle(trainer, passes, steps))
        for work in plan.barriers:
            await self._guarded([work], self._run_barrier(work))

    async def _mark_running(self, works: list[Work]) -> None:
        await asyncio.to_thread(self.store.mark_running, [(w.run_id, w.seq_id) for w in works])

    async def _guarded(self, works: list[Work], coro) -> bool:
        """Run ``coro``; on failure fail every work in it with a domain error (never lose a future).
        Returns whether it succeeded."""
        try:
            await coro
            return True
        except Exception as exc:  # noqa: BLE001 - every failure must reach the waiting callers
            error = exc if isinstance(exc, TemperError) else TemperError(f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, TemperError):
                log.exception("cycle failed")
            try:
                await self._record(works, error)
            except Exception:  # noqa: BLE001 - the database may be what failed; the callers still hear
                log.exception("could not record the failure of %d requests", len(works))
            for work in works:
                work.fail(error)
            return False

    async def _dispatch_cycle(self, trainer: TrainerHandle, passes: list[Work], steps: list[Work]) -> None:
        request = trainer_pb2.CycleRequest()
        for work in passes:
            r = work.request
            request.forward_backward.add(training_run_id=work.run_id, data=r.data, loss_fn=r.loss_fn, loss_fn_config=r.loss_fn_config,
                                         forward_only=r.forward_only, seq_id=work.seq_id)
        for work in steps:
            request.optim_step.add(training_run_id=work.run_id, adam_params=work.request.adam_params, seq_id=work.seq_id)
        async with downstream(f"trainer {trainer.address}"):
            response = await trainer.stub.RunCycle(request)
        answers = [*zip(passes, response.forward_backward),
                   *((work, service_pb2.OptimStepResponse(metrics=out.metrics)) for work, out in zip(steps, response.optim_step))]
        await self._record([work for work, _ in answers], None, [answer for _, answer in answers])
        for work, answer in answers:
            work.resolve(answer)

    async def _run_barrier(self, work: Work) -> None:
        await self._mark_running([work])
        trainer = self.backends.trainer_for(self.run_models[work.run_id], work.run_id)
        request = work.request
        if work.kind is WorkKind.SAVE_WEIGHTS:
            path = CheckpointPath(work.run_id, request.kind, request.name)
            async with downstream(f"trainer {trainer.address}"):
                saved = await trainer.stub.SaveAdapter(trainer_pb2.SaveAdapterRequest(
                    training_run_id=work.run_id, checkpoint_key=path.key,
                    include_optimizer=request.kind == types_pb2.CHECKPOINT_KIND_TRAINING,
                ))
            row = await asyncio.to_thread(self.store.add_checkpoint, work.run_id, KIND_NAMES[request.kind], request.name, str(path), saved.size_bytes)
            if request.kind == types_pb2.CHECKPOINT_KIND_SAMPLER:
                # Push now so a sampling client on this checkpoint starts without waiting for weights.
                sampler = self.backends.sampler_for(self.run_models[work.run_id])
                await self.backends.push_checkpoint(trainer, sampler, path.key)
            result = service_pb2.SaveWeightsResponse(checkpoint=checkpoint_message(row))
        else:
            path = request.path
            key = parse_path(path).key
            async with downstream(f"trainer {trainer.address}"):
                await trainer.stub.LoadAdapter(trainer_pb2.LoadAdapterRequest(
                    training_run_id=work.run_id, checkpoint_key=key, with_optimizer=request.with_optimizer))
            result = service_pb2.LoadWeightsResponse(path=path)
        await self._record([work], None, [result])
        work.resolve(result)

    async def _record(self, works: list[Work], error: TemperError | None, answers: list | None = None) -> None:
        """Outcomes, counters and (on success) each answer, kept for retries after a restart."""
        status = "failed" if error else "done"
        blobs = [a.SerializeToString() for a in answers] if answers is not None else [None] * len(works)
        outcomes = [(w.run_id, w.seq_id, status, error.message if error else None, blob) for w, blob in zip(works, blobs)]
        tokens, steps, next_seq = defaultdict(int), defaultdict(int), {}
        for w in works:
            next_seq[w.run_id] = max(next_seq.get(w.run_id, 0), w.seq_id + 1)
            if not error and w.kind is WorkKind.FORWARD_BACKWARD:
                tokens[w.run_id] += w.num_tokens
            if not error and w.kind is WorkKind.OPTIM_STEP:
                steps[w.run_id] += 1
        await asyncio.to_thread(self.store.finish_requests, outcomes, tokens, steps, next_seq, self.result_window)


def checkpoint_message(row) -> types_pb2.Checkpoint:
    kind = {v: k for k, v in KIND_NAMES.items()}[row.kind]
    return types_pb2.Checkpoint(
        checkpoint_id=f"{KIND_DIRS[kind]}/{row.name}", kind=kind, path=row.path, training_run_id=row.training_run_id,
        size_bytes=row.size_bytes, created_unix_ms=int(row.created_at.timestamp() * 1000),
    )
