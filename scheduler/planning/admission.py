"""Admission: the one place a sequenced request (forward_backward, optim_step, save, load) enters.

For each request, in order: the run (metadata held once, in RunRegistry); payload hash and
validation (in a worker thread when the request is large); dedupe (a retry of a (run, seq) gets the
first request's answer, from memory or from the database; the database is asked only about seqs
that can have a row not in memory: ``RunQueue.lookup_upto``); seq order; capacity (per run, per tenant,
global); claim (from here a retry waits for this request's answer); the request row, committed
together with the rows of the requests admitted at the same time (``group_commit.py``); the queue.

A request is answered failed only when it was not and will not be applied. A rejection spends its
seq (the client numbered later requests after it) but changes nothing else. When the database is
unavailable nothing is claimed or spent: the answer is UNAVAILABLE and the client resends the seq.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict, defaultdict
from typing import Awaitable, Callable

from temper.common.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, LeaseLost, ResourceExhausted, TemperError,
                                  Unavailable)
from temper.common.strings import check_request_strings
from temper.scheduler import metrics
from temper.scheduler.db.request_log import NewRequest
from temper.scheduler.planning.group_commit import RequestWriter
from temper.scheduler.tenancy.auth import caller_key_prefix
from temper.scheduler.tenancy.quotas import Quotas
from temper.scheduler.planning.runs import RunInfo, RunRegistry
from temper.scheduler.settings import SchedulerSettings
from temper.scheduler.planning.work import RunQueue, Work, WorkKind, WorkState
from temper.v1 import service_pb2, types_pb2

log = logging.getLogger(__name__)
ANSWER_TYPES = {  # what each sequenced verb answers (RequestRecord.result holds it serialized)
    WorkKind.FORWARD_BACKWARD: types_pb2.ForwardBackwardOutput, WorkKind.FORWARD: types_pb2.ForwardBackwardOutput,
    WorkKind.OPTIM_STEP: service_pb2.OptimStepResponse, WorkKind.SAVE_WEIGHTS: service_pb2.SaveWeightsResponse,
    WorkKind.LOAD_WEIGHTS: service_pb2.LoadWeightsResponse,
}
# the verbs that change an adapter: their requests are logged for replay onto a restored one (forward changes nothing)
LOGGED_KINDS = (WorkKind.FORWARD_BACKWARD, WorkKind.OPTIM_STEP, WorkKind.LOAD_WEIGHTS)
# seq_ids at or above this are refused: the run's next seq (a BIGINT) must stay far from 2**63 - 1,
# even after a gap before a high seq is skipped (seq_gap_timeout_seconds)
MAX_SEQ_ID = 2**62 - 1
# How far ahead of the run's next expected seq a request may be: further, and no client pipelines
# that deep, so it is a wrong seq (INVALID_ARGUMENT). Nearer, past max_queued_per_run, it waits:
# RESOURCE_EXHAUSTED, and its resend is admitted once the run has caught up.
MAX_SEQ_AHEAD = 1 << 20
SKIPPED = "skipped"  # the payload hash of an abandoned seq's placeholder: no request has it
INLINE_CHECK_BYTES = 64 * 1024  # smaller requests are hashed and checked on the event loop: cheaper than a thread hop
Check = Callable[[RunInfo], int]                 # CPU-only validation; returns the request's token count
AsyncCheck = Callable[[RunInfo], Awaitable[None]]  # validation that needs the database or other runs


class Admission:
    def __init__(self, store, runs: RunRegistry, settings: SchedulerSettings, quotas: Quotas | None = None):
        self.store = store
        self.runs = runs
        self.settings = settings
        self.quotas = quotas if quotas is not None else Quotas(store, settings)
        self.queues: dict[str, RunQueue] = {}
        self.recent: OrderedDict[tuple[str, int], Work] = OrderedDict()  # claimed work, answers retried (run, seq)
        self.wake = Wakeup()
        self.writer = RequestWriter(store)
        metrics.watch_queues(self)

    # ---- the request path ---------------------------------------------------------------------

    async def submit(self, run_id: str, seq_id: int, kind: WorkKind, request, check: Check | None = None,
                     check_async: AsyncCheck | None = None, tenant: str | None = None, offload: bool = False):
        """``tenant``: the caller; another tenant's run answers NotFound before anything is looked at.
        ``offload``: ``check`` is CPU work (images to decode) and runs in a thread whatever the request's size."""
        run = await self.runs.get(run_id, tenant)
        await self.quotas.limits(run.tenant)  # fresh in the cache for the capacity check below
        if not 1 <= seq_id <= MAX_SEQ_ID:
            raise InvalidArgument(f"seq_id must be in [1, 2**62), got {seq_id}")
        if not offload and request.ByteSize() <= INLINE_CHECK_BYTES:
            sha, tokens, invalid, serialized = _digest_and_check(request, check, run)
        else:
            sha, tokens, invalid, serialized = await asyncio.to_thread(_digest_and_check, request, check, run)
        # the request log of trainer recovery (recovery.py): what a restored adapter replays
        payload = serialized if self.settings.recovery != "off" and kind in LOGGED_KINDS else None
        queue = self._queue(run)
        existing = self._known(run_id, seq_id)
        recorded = False
        if existing is None and seq_id <= queue.lookup_upto:  # above it, the database has no row that memory lacks
            record = await asyncio.to_thread(self.store.get_request, run_id, seq_id)
            existing = self._known(run_id, seq_id)  # another retry may have arrived meanwhile
            if existing is None and record is not None:
                answer = _answer_from_record(record, sha)
                if answer is not None:
                    return answer
                # Accepted by an earlier process (or left by a worker that did not answer) and never
                # answered: queued again on its existing row. If it had reached the trainer, the trainer
                # answers it from memory by its seq instead of applying it twice.
                recorded = True
        if existing is not None:
            if existing.payload_sha256 is SKIPPED:
                raise Unavailable(f"seq_id {seq_id} of {run_id} is being abandoned by its client; retry")
            if existing.payload_sha256 != sha:
                raise AlreadyExists(f"seq_id {seq_id} of {run_id} was used by a different request")
            return await asyncio.shield(existing.future)
        if run.closed:
            raise FailedPrecondition(f"the session of {run_id} is closed; its runs take no more work")
        if queue.was_skipped(seq_id):
            raise _skipped(run_id, seq_id)
        if seq_id < queue.next_seq_id:
            raise InvalidArgument(f"seq_id {seq_id} of {run_id} is behind the next expected seq_id {queue.next_seq_id}")
        if seq_id - queue.next_seq_id > MAX_SEQ_AHEAD:
            raise InvalidArgument(f"seq_id {seq_id} of {run_id} is more than {MAX_SEQ_AHEAD} ahead of the next expected "
                                  f"seq_id {queue.next_seq_id}")
        self._check_capacity(run, queue, seq_id, kind)
        work = Work(run_id, seq_id, kind, request, sha, tokens, run.tenant, WorkState.CLAIMED)
        work.deterministic = bool(run.row.deterministic)
        work.key_prefix = caller_key_prefix(run.tenant)
        work.resent = recorded  # its row was left queued or running: it may have reached a trainer (a save tolerates its files)
        self._claim(queue, work)  # no await since the capacity check: the limit holds exactly
        try:
            if invalid is not None:
                raise invalid
            if check_async is not None and not recorded:  # a resent row passed them when first admitted; its own
                await check_async(run)                     # effects (e.g. its checkpoint row) must not refuse it now
            if not recorded:
                await self.writer.add(NewRequest(run_id, seq_id, kind.value, sha, "queued", tokens, None, payload))
        except (Unavailable, LeaseLost) as exc:  # not written: nothing claimed or spent, the client resends
            self._forget(queue, work, exc)
            metrics.ADMISSIONS.labels(kind.value, "UNAVAILABLE").inc()
            raise
        except BaseException as exc:
            self._reject(work, exc)
            raise
        work.state = WorkState.QUEUED
        metrics.ADMISSIONS.labels(kind.value, "admitted").inc()
        self.wake.set()
        return await asyncio.shield(work.future)

    async def abandon(self, run_id: str, seq_id: int, tenant: str | None = None) -> bool:
        """Its client gave up on (run, seq) (AbandonSeq). True: it was never recorded and is now skipped,
        durably, so the run's later work goes on at once; False: it was recorded (or refused) and keeps
        its place. Skipping a row left queued is safe: queued means it never left the scheduler."""
        run = await self.runs.get(run_id, tenant)
        if not 1 <= seq_id <= MAX_SEQ_ID:
            raise InvalidArgument(f"seq_id must be in [1, 2**62), got {seq_id}")
        queue = self._queue(run)
        if queue.was_skipped(seq_id):
            return True
        if (work := self._known(run_id, seq_id) or queue.pending.get(seq_id)) is None:
            if seq_id - queue.next_seq_id > MAX_SEQ_AHEAD:
                raise InvalidArgument(f"seq_id {seq_id} of {run_id} is more than {MAX_SEQ_AHEAD} ahead of the next expected "
                                      f"seq_id {queue.next_seq_id}")
            # held in ``recent`` meanwhile: a resend racing this abandonment is answered UNAVAILABLE (and resent)
            self._claim_key(Work(run_id, seq_id, WorkKind.FORWARD, None, SKIPPED, 0, run.tenant, WorkState.CLAIMED))
            try:
                # a queued row below next_seq_id may be in a cycle already: only one ahead is skipped
                status = await asyncio.to_thread(self.store.skip_request, run_id, seq_id, seq_id >= queue.next_seq_id)
            finally:
                self.recent.pop((run_id, seq_id), None)
                self.forgot(run_id, seq_id)
            if status != "skipped":
                return False
            queue.skip(seq_id)
            log.info("run %s: seq %d skipped, its client gave up on it", run_id, seq_id)
            self.wake.set()
            return True
        if work.state is WorkState.CLAIMED:
            raise Unavailable(f"seq_id {seq_id} of {run_id} is being admitted; retry")
        return work.rejected

    def _queue(self, run: RunInfo) -> RunQueue:
        return self.queues.get(run.run_id) or self.queues.setdefault(
            run.run_id, RunQueue(run.run_id, run.row.next_seq_id, run.recorded_upto, run.tenant, run.skipped))

    def _known(self, run_id: str, seq_id: int) -> Work | None:
        return self.recent.get((run_id, seq_id))

    def _check_capacity(self, run: RunInfo, queue: RunQueue, seq_id: int, kind: WorkKind) -> None:
        """Full: nothing is claimed; the client resends the same seq later (RESOURCE_EXHAUSTED is backpressure).
        Work parked behind a missing seq counts against its own run only."""
        if seq_id == queue.next_seq_id:
            return  # the request this run's work waits for is always admitted, or the run would deadlock
        limits = [(len(queue), self.settings.max_queued_per_run, f"run {run.run_id}")]
        if queue.extends_chain(seq_id):
            tenant_limit, total_limit = self.quotas.cached(run.tenant).max_queued_requests, self.settings.max_queued_requests
            if tenant_limit or total_limit:
                mine, everyone = self._unparked(run.tenant)
                limits += [(mine, tenant_limit, f"tenant {run.tenant!r}"), (everyone, total_limit, "the scheduler")]
        for used, limit, who in limits:
            if limit and used >= limit:
                metrics.ADMISSIONS.labels(kind.value, "RESOURCE_EXHAUSTED").inc()
                raise ResourceExhausted(f"{who} has {used} queued requests (limit {limit}); retry with backoff")
        ahead, most = seq_id - queue.next_seq_id, self.settings.max_queued_per_run
        if most and ahead > most:  # parked so far ahead, it would wait behind more seqs than the run may hold
            metrics.ADMISSIONS.labels(kind.value, "RESOURCE_EXHAUSTED").inc()
            raise ResourceExhausted(f"seq_id {seq_id} of run {run.run_id} is {ahead} ahead of the next expected seq_id "
                                    f"(at most {most} may wait); retry with backoff")

    def _unparked(self, tenant: str) -> tuple[int, int]:
        """Requests held and not parked behind a missing seq: ``tenant``'s, and everyone's (one pass
        over the queues, the capacity check's share of ``depth_by_tenant``)."""
        mine = everyone = 0
        for queue in self.queues.values():
            if queue.pending and (count := queue.unparked()):
                everyone += count
                if queue.tenant == tenant:
                    mine += count
        return mine, everyone

    def _claim(self, queue: RunQueue, work: Work) -> None:
        queue.add(work)
        self._claim_key(work)

    def _claim_key(self, work: Work) -> None:
        work.future = asyncio.get_running_loop().create_future()
        work.submitted_at = time.monotonic()
        self.recent[(work.run_id, work.seq_id)] = work
        while len(self.recent) > self.settings.result_cache_size:
            self.forgot(*self.recent.popitem(last=False)[0])

    def forgot(self, run_id: str, seq_id: int) -> None:
        """(run, seq) left ``recent`` while it may have a row: its retries look in the database."""
        queue = self.queues.get(run_id)
        if queue is not None:
            queue.lookup_upto = max(queue.lookup_upto, seq_id)

    def _reject(self, work: Work, exc: BaseException) -> None:
        """Bad input: answered now; its seq is spent and skipped when it comes (a retry gets the same answer)."""
        work.state = WorkState.REJECTED
        work.fail(exc)
        code = exc.code.name if isinstance(exc, TemperError) else "INTERNAL"
        metrics.ADMISSIONS.labels(work.kind.value, code).inc()
        self.wake.set()

    def _forget(self, queue: RunQueue, work: Work, exc: BaseException) -> None:
        """Not admitted and not spent: as if the request had never arrived (its retry starts afresh)."""
        queue.remove(work)
        if self.recent.get((work.run_id, work.seq_id)) is work:
            del self.recent[(work.run_id, work.seq_id)]
        self.forgot(work.run_id, work.seq_id)  # an outage may have hidden a committed write
        work.fail(exc)

    # ---- the loop's side ----------------------------------------------------------------------

    def ready(self, include: Callable[[str], bool] | None = None) -> dict[str, list[Work]]:
        """Each run's work that may go now (of the runs ``include`` takes, if given); a tenant over its
        train_tokens_per_minute waits."""
        ready = {run_id: q.ready() for run_id, q in self.queues.items() if q.pending and (include is None or include(run_id))}
        ready = {run_id: works for run_id, works in ready.items() if works and self.quotas.train_wait(works[0].tenant) <= 0}
        # Oldest head first, so a run that has waited longest is served first.
        return dict(sorted(((r, w) for r, w in ready.items() if w), key=lambda item: item[1][0].submitted_at))

    def take(self, works: list[Work]) -> None:
        for work in works:
            self.queues[work.run_id].take(work)
            if work.kind.is_pass:
                self.quotas.trained.record(work.tenant, work.num_tokens)

    def release(self, works: list[Work], error: Unavailable) -> None:
        """Taken work whose outcome is unknown (a worker did not answer): answered UNAVAILABLE and
        forgotten, and each run expects the seq again; the client's resend learns the true outcome
        (the trainer answers a seq it applied from memory; the row stays as it was)."""
        for work in sorted(works, key=lambda w: w.seq_id, reverse=True):
            self.queues[work.run_id].rewind(work.seq_id)
            if self.recent.get((work.run_id, work.seq_id)) is work:
                del self.recent[(work.run_id, work.seq_id)]
            self.forgot(work.run_id, work.seq_id)
            metrics.UNKNOWN_OUTCOMES.labels(work.kind.value).inc()
            work.fail(error)
        self.wake.set()

    def hold(self, works: list[Work]) -> None:
        """Taken work that did not run because its run's adapter was lost with its trainer: queued
        again as it was, its callers still waiting, to run once the run is restored (recovery.py).
        It is marked resent (it may have reached the dead trainer)."""
        for work in sorted(works, key=lambda w: w.seq_id, reverse=True):
            queue = self.queues[work.run_id]
            work.resent = True
            queue.add(work)
            queue.rewind(work.seq_id)
        self.wake.set()

    def fail_all(self, error: TemperError) -> None:
        """The loop is gone: every waiting caller hears ``error`` now rather than hanging."""
        for work in [*self.recent.values(), *(w for q in self.queues.values() for w in q.pending.values())]:
            work.fail(error)

    async def wait_for_work(self, waiter: asyncio.Event | None = None) -> None:
        """Until work arrives or a run's missing seq has waited for long enough."""
        waiter = waiter if waiter is not None else self.wake.default
        gaps = [since for q in self.queues.values() if (since := q.gap_since()) is not None]
        waits = []
        if gaps and self.settings.seq_gap_timeout_seconds > 0:
            waits.append(max(0.0, min(gaps) + self.settings.seq_gap_timeout_seconds - time.monotonic()))
        # tenants held back by their train_tokens_per_minute (only a tenant with such a limit can be)
        throttled = {q.tenant for q in self.queues.values() if q.pending and self.quotas.cached(q.tenant).train_tokens_per_minute
                     and q.ready()}
        waits += [wait for tenant in throttled if (wait := self.quotas.train_wait(tenant)) > 0]
        timeout = min(waits) if waits else None
        try:
            await asyncio.wait_for(waiter.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        waiter.clear()
        self.skip_expired_gaps()

    def skip_expired_gaps(self) -> None:
        """Give up on missing seqs waited for longer than seq_gap_timeout_seconds (checked between
        cycles too, so a gap expires on time under other tenants' load)."""
        if self.settings.seq_gap_timeout_seconds <= 0:
            return
        now = time.monotonic()
        for queue in self.queues.values():
            since = queue.gap_since()
            if since is not None and now - since >= self.settings.seq_gap_timeout_seconds:
                gap = queue.skip_gap()
                log.warning("run %s: skipped seq %d-%d after waiting %.0f s for it", queue.run_id, gap.start, gap.stop - 1, now - since)

    def depth_by_tenant(self) -> dict[str, tuple[int, int]]:
        """tenant -> (requests held, of which parked behind a missing seq)."""
        depth: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for run_id, queue in self.queues.items():
            info = self.runs.known(run_id)
            entry = depth[info.tenant if info else "?"]
            entry[0] += len(queue)
            entry[1] += len(queue) - queue.unparked()
        return {tenant: (held, parked) for tenant, (held, parked) in depth.items()}

    def next_seq_id(self, run: RunInfo) -> int:
        queue = self.queues.get(run.run_id)
        return queue.next_seq_id if queue is not None else run.row.next_seq_id


def _digest_and_check(request, check: Check | None, run: RunInfo) -> tuple[str, int, BaseException | None, bytes]:
    """One worker-thread call: the payload hash (dedupe) and the CPU validation (decoded once here;
    the trainer's deep check is the other); and the request serialized (the request log's payload)."""
    serialized = request.SerializeToString(deterministic=True)
    sha = hashlib.sha256(serialized).hexdigest()
    try:
        check_request_strings(request)
        return sha, (check(run) if check is not None else 0), None, serialized
    except TemperError as exc:
        return sha, 0, exc, serialized


def _skipped(run_id: str, seq_id: int) -> FailedPrecondition:
    return FailedPrecondition(f"seq_id {seq_id} of {run_id} was skipped: its client gave up on it (AbandonSeq), or the "
                              f"scheduler stopped waiting for it (seq_gap_timeout_seconds); the run's later requests "
                              f"went on without it")


def _answer_from_record(record, sha: str):
    """The stored answer of a request an earlier process completed; None when it must be queued again."""
    if record.status == "skipped":
        raise _skipped(record.training_run_id, record.seq_id)
    if record.payload_sha256 != sha:
        raise AlreadyExists(f"seq_id {record.seq_id} of {record.training_run_id} was used by a different request")
    return stored_answer(record)


def stored_answer(record):
    """A request row's answer (its kind's message); None while it is queued or running; FailedPrecondition
    when it failed or its answer is no longer held. Also GetRequestResult's (lookup_verbs.py)."""
    if record.status == "done" and record.result is not None:
        return ANSWER_TYPES[WorkKind(record.kind)].FromString(record.result)
    if record.status in ("queued", "running"):
        return None
    if record.status == "skipped":
        raise _skipped(record.training_run_id, record.seq_id)
    detail = f": {record.error}" if record.error else ""
    raise FailedPrecondition(f"seq_id {record.seq_id} of {record.training_run_id} already ran ({record.status}{detail}); "
                             f"its result is no longer held")


class Wakeup:
    """"Work may be ready", told to every waiter at once: each lane waits on its own event, so a lane
    that wakes and clears its event never hides new work from another lane."""

    def __init__(self):
        self.default = asyncio.Event()
        self._waiters: list[asyncio.Event] = [self.default]

    def waiter(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()  # a new waiter looks at the queues once before it first waits
        self._waiters.append(event)
        return event

    def set(self) -> None:
        for event in self._waiters:
            event.set()

