"""The scheduler loop: plan a cycle from the ready queues, run it on the trainers, record, answer.

    while True:
        wait until work arrives (or a run's missing seq was waited for too long: skip it)
        while (plan := plan_cycle(ready work, budget)):
            take the planned work off its queues
            mark it running, run the passes and optim steps (one call per trainer), then each
            barrier (save / load) on its own; record the outcomes; answer the callers

Outcomes are told honestly: work a trainer refused is answered failed (the trainer validates a
whole cycle before it touches anything); work whose trainer did not answer is resent for a while
(the trainer answers a seq it applied from memory) and then answered UNAVAILABLE, so the client's
resend learns the true outcome; a database outage delays recording and answers, never loses them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from datetime import timezone

from temper.common.checkpoints import CheckpointPath, KIND_DIRS, parse_path
from temper.common.errors import AlreadyExists, TemperError, Unavailable
from temper.scheduler import metrics
from temper.scheduler.admission import Admission
from temper.scheduler.backends import Backends, TrainerHandle
from temper.scheduler.policy import CyclePlan, FairShare, plan_cycle
from temper.scheduler.runs import RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.work import Work, WorkKind
from temper.v1 import service_pb2, trainer_pb2, types_pb2

log = logging.getLogger(__name__)
KIND_NAMES = {types_pb2.CHECKPOINT_KIND_SAMPLER: "sampler", types_pb2.CHECKPOINT_KIND_TRAINING: "training"}


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

    async def run_forever(self) -> None:
        while True:
            await self.admission.wait_for_work()
            while plan := plan_cycle(self.admission.ready(), self.settings.cycle_token_budget, self.runs.tenant_by_run(), self.share):
                self.admission.take(plan.all_work())
                await self._run_cycle(plan)
                self.admission.skip_expired_gaps()

    async def _run_cycle(self, plan: CyclePlan) -> None:
        self.cycles += 1
        started, outcome = time.monotonic(), "ok"
        in_pass = plan.passes + plan.optim_steps
        try:
            if in_pass:
                # Recorded before anything reaches a trainer: after a crash, "running" rows are the ones
                # that may have been applied (see Store.recover_interrupted).
                await self._persist(self.store.mark_running, [(w.run_id, w.seq_id) for w in in_pass])
            by_trainer: dict[str, tuple[TrainerHandle, list[Work], list[Work]]] = {}
            for work in in_pass:
                trainer = self._trainer_of(work)
                by_trainer.setdefault(trainer.address, (trainer, [], []))[1 if work.kind.is_pass else 2].append(work)
            for trainer, passes, steps in by_trainer.values():
                outcome = _worse(outcome, await self._cycle_on(trainer, passes, steps, plan))
            for work in plan.barriers:
                outcome = _worse(outcome, await self._barrier(work, plan))
        except BaseException:
            log.error("cycle %d stopped the loop; plan: %s", self.cycles, describe(plan))
            raise
        finally:
            elapsed = time.monotonic() - started
            tokens = sum(w.num_tokens for w in plan.passes)
            metrics.CYCLES.labels(outcome).inc()
            metrics.CYCLE_SECONDS.observe(elapsed)
            metrics.CYCLE_TOKENS.observe(tokens)
        log.info("cycle %d %s: %d runs, %d tenants, %d tokens, %d passes, %d steps, %d barriers, %.0f ms", self.cycles, outcome,
                 len({w.run_id for w in plan.all_work()}), len({w.tenant for w in plan.all_work()}), tokens, len(plan.passes),
                 len(plan.optim_steps), len(plan.barriers), elapsed * 1000)

    def _trainer_of(self, work: Work) -> TrainerHandle:
        return self.backends.trainer_for(self.runs.known(work.run_id).base_model, work.run_id)

    async def _cycle_on(self, trainer: TrainerHandle, passes: list[Work], steps: list[Work], plan: CyclePlan) -> str:
        request = trainer_pb2.CycleRequest()
        for work in passes:
            r = work.request
            request.forward_backward.add(training_run_id=work.run_id, data=r.data, loss_fn=r.loss_fn, loss_fn_config=r.loss_fn_config,
                                         forward_only=r.forward_only, seq_id=work.seq_id)
        for work in steps:
            request.optim_step.add(training_run_id=work.run_id, adam_params=work.request.adam_params, seq_id=work.seq_id)
        outcome = await self._call_trainer(lambda resent: trainer.run_cycle(request), passes + steps, plan)
        if isinstance(outcome, str):
            return outcome
        answers = [*outcome.forward_backward, *(service_pb2.OptimStepResponse(metrics=out.metrics) for out in outcome.optim_step)]
        await self._finish(passes + steps, answers=answers)
        return "ok"

    async def _barrier(self, work: Work, plan: CyclePlan) -> str:
        await self._persist(self.store.mark_running, [(work.run_id, work.seq_id)])
        trainer = self._trainer_of(work)
        apply = self._save if work.kind is WorkKind.SAVE_WEIGHTS else self._load
        outcome = await self._call_trainer(lambda resent: apply(trainer, work, resent), [work], plan)
        if isinstance(outcome, str):
            return outcome
        await self._finish([work], answers=[outcome])
        return "ok"

    async def _call_trainer(self, call, works: list[Work], plan: CyclePlan):
        """The trainer's answer; or, having answered the callers, "failed" (the trainer refused: nothing
        was applied) or "unknown" (no answer within dispatch_retry_seconds: UNAVAILABLE, resend)."""
        deadline, delay, resent = time.monotonic() + self.settings.dispatch_retry_seconds, 0.2, False
        while True:
            try:
                return await call(resent)
            except Unavailable as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("no answer from the trainer for %d requests (%s); answered UNAVAILABLE; plan: %s",
                                len(works), exc.message, describe(plan))
                    self.admission.release(works, Unavailable(f"{exc.message}; whether it was applied is not known yet: resend it"))
                    return "unknown"
                log.warning("%s; resending in %.1f s", exc.message, delay)
                await asyncio.sleep(delay)
                delay, resent = min(delay * 2, 5.0), True
            except TemperError as exc:
                log.warning("trainer refused %d requests: %s: %s; plan: %s", len(works), exc.code.name, exc.message, describe(plan))
                await self._finish(works, error=exc)
                return "failed"

    async def _save(self, trainer: TrainerHandle, work: Work, resent: bool) -> service_pb2.SaveWeightsResponse:
        request = work.request
        path = CheckpointPath(work.run_id, request.kind, request.name)
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
        row = await self._persist(self.store.add_or_get_checkpoint, work.run_id, KIND_NAMES[request.kind], request.name, str(path), size,
                                  request.ephemeral, request.ttl_seconds)
        if request.kind == types_pb2.CHECKPOINT_KIND_SAMPLER:
            # Pushed now so a sampling client starts without waiting; if the sampler is down, the first
            # sampling client on this checkpoint pushes it instead.
            try:
                sampler = self.backends.sampler_for(self.runs.known(work.run_id).base_model)
                limit = self.admission.quotas.cached(work.tenant).max_resident_adapters
                await self.backends.push_checkpoint(trainer, sampler, path.key, tenant=work.tenant, max_resident=limit)
            except TemperError as exc:
                log.warning("could not push %s to a sampler now: %s", path.key, exc.message)
        return service_pb2.SaveWeightsResponse(checkpoint=checkpoint_message(row))

    async def _load(self, trainer: TrainerHandle, work: Work, resent: bool) -> service_pb2.LoadWeightsResponse:
        request = work.request
        await trainer.call("LoadAdapter", trainer_pb2.LoadAdapterRequest(
            training_run_id=work.run_id, checkpoint_key=parse_path(request.path).key, with_optimizer=request.with_optimizer))
        return service_pb2.LoadWeightsResponse(path=request.path)

    async def _finish(self, works: list[Work], answers: list | None = None, error: TemperError | None = None) -> None:
        """Record outcomes, counters and (on success) each answer, kept for retries after a restart;
        then answer the callers. A database outage delays this; it never turns into a wrong answer."""
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
        await self._persist(self.store.finish_requests, outcomes, tokens, steps, next_seq, self.settings.durable_results_per_run)
        for w, answer in zip(works, answers or [None] * len(works)):
            if error:
                w.fail(error)
            else:
                if w.kind is WorkKind.FORWARD_BACKWARD:
                    metrics.TOKENS_TRAINED.labels(w.tenant).inc(w.num_tokens)
                w.resolve(answer)

    async def _persist(self, fn, *args):
        """A store call, retried for as long as the database is unavailable (the loop can do nothing
        else meanwhile: every cycle starts and ends with a write)."""
        delay = 0.1
        while True:
            try:
                return await asyncio.to_thread(fn, *args)
            except Unavailable as exc:
                log.warning("%s; retrying %s in %.1f s", exc.message, getattr(fn, "__name__", "the write"), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _worse(a: str, b: str) -> str:
    order = ("ok", "failed", "unknown")
    return max(a, b, key=order.index)


def describe(plan: CyclePlan) -> str:
    """The plan, one entry per work item, for logs of a failed cycle."""
    return ", ".join(f"{w.kind.value}({w.run_id}#{w.seq_id}, {w.num_tokens} tok, tenant {w.tenant})" for w in plan.all_work())


def checkpoint_message(row) -> types_pb2.Checkpoint:
    kind = {v: k for k, v in KIND_NAMES.items()}[row.kind]
    return types_pb2.Checkpoint(
        checkpoint_id=f"{KIND_DIRS[kind]}/{row.name}", kind=kind, path=row.path, training_run_id=row.training_run_id,
        size_bytes=row.size_bytes, created_unix_ms=_unix_ms(row.created_at), published=bool(row.published),
        expires_unix_ms=_unix_ms(row.expires_at) if row.expires_at is not None else 0,
    )


def _unix_ms(value) -> int:
    if value.tzinfo is None:  # SQLite hands back naive UTC
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)
