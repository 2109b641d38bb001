"""Samplers as the scheduler sees them: which adapters each holds, how busy it is, which one serves
a request, and the calls to them (mixed into ``backends.Backends``).

Choice (``sampler_for``): a request for a checkpoint goes to the least loaded sampler of its base
model that already holds the checkpoint's adapter, unless that one has more than
``sampler_affinity_slack`` requests in flight beyond the least loaded sampler of the model; then,
and for a checkpoint no sampler holds, to the least loaded sampler, which gets the adapter pushed.
Base-model requests go to the least loaded sampler. Load is this scheduler's requests in flight to
the sampler, adapter pushes included; of equally loaded samplers, the one chosen longest ago. Every request is placed anew:
no sampling client is tied to a sampler.

Failure (``on_a_sampler``): sampling is stateless apart from adapters, so a call to a sampler that
cannot be reached, or that dies or gives no answer mid-call, is made again on another sampler of the
model (the adapter pushed there first); only when none answers does the caller get Unavailable. A
sampler that failed is chosen last for ``SUSPECT_SECONDS`` and is asked for its model info before it
is used again: a new ``incarnation`` means it restarted and holds none of the adapters pushed before.
An answer "ADAPTER_NOT_LOADED" asks too (the sampler evicted it, or restarted unnoticed), then the
adapter is pushed again and the call retried once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from temper.common.errors import Abandoned, AdapterNotLoaded, TemperError, Unavailable
from temper.common.retry import retry
from temper.scheduler import metrics
from temper.scheduler.workers.abandon import Calls
from temper.scheduler.workers.downstream import downstream
from temper.scheduler.workers.events import cluster_event
from temper.scheduler.settings import SchedulerSettings
from temper.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
SUSPECT_SECONDS = 5.0       # a sampler that failed is chosen last for this long (still tried when the others fail too)
INFO_TIMEOUT_SECONDS = 10.0


class SamplerUnavailable(Unavailable):
    """A sampler could not be reached or did not answer (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED):
    another sampler of the model can take the call."""


class CheckpointSource(Protocol):
    """Where pushed adapter files come from (a TrainerHandle): backends builds on samplers, not the
    other way round."""

    def read_checkpoint(self, key: str, weights_only: bool = False) -> AsyncIterator: ...


@dataclass(eq=False)
class SamplerHandle:
    address: str
    stub: sampler_pb2_grpc.SamplerStub
    info: sampler_pb2.SamplerModelInfo
    settings: SchedulerSettings
    # checkpoint keys pushed here -> the tenant that pushed it ("": not known), least recently used first
    loaded: OrderedDict[str, str] = field(default_factory=OrderedDict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # pushes and drops, one at a time
    in_flight: int = 0           # this scheduler's requests on it now, pushes included: its load
    suspect_until: float = 0.0   # it failed: chosen last until then (time.monotonic)
    recheck: bool = False        # it failed: ask for its model info (incarnation) before using it again
    chosen: int = 0              # when it was last chosen (a count of choices): equal loads go to the longest unchosen
    calls: Calls = field(init=False, repr=False)  # waiting now: given up when it is marked down (abandon.py)

    def __post_init__(self):
        self.calls = Calls(f"sampler {self.address}", "is marked down")

    async def call(self, method: str, request, timeout: float | None = None):
        async with downstream(f"sampler {self.address}", SamplerUnavailable):
            return await self.calls.run(getattr(self.stub, method)(request, timeout=timeout or self.settings.sampler_call_timeout_seconds))

    def abandon(self) -> int:
        """Give up every call waiting on this sampler now (it sent no heartbeat: membership.py); each
        raises Abandoned in its caller, and sampling routing tries another sampler. How many."""
        return self.calls.abandon()

    @contextmanager
    def busy(self):
        self.in_flight += 1
        metrics.SAMPLER_IN_FLIGHT.labels(self.address).inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            metrics.SAMPLER_IN_FLIGHT.labels(self.address).dec()

    def suspect(self, now: float) -> bool:
        return now < self.suspect_until

    def failed(self) -> None:
        self.suspect_until = max(self.suspect_until, time.monotonic() + SUSPECT_SECONDS)  # marked down (inf) stays so
        self.recheck = True
        metrics.SAMPLER_FAILURES.labels(self.address).inc()

    def adopt(self, info: sampler_pb2.SamplerModelInfo) -> None:
        """Take a fresh GetModelInfo answer: a new incarnation (the sampler restarted) holds none of the
        adapters pushed to the last; keys the sampler no longer lists (it evicted them) are forgotten."""
        if info.incarnation != self.info.incarnation:
            log.warning("sampler %s restarted (incarnation %s -> %s): the %d adapters pushed before are gone",
                        self.address, self.info.incarnation or "?", info.incarnation or "?", len(self.loaded))
            self.loaded.clear()
        held = set(info.loaded_adapters)
        for key in [k for k in self.loaded if k not in held]:
            del self.loaded[key]
        for key in info.loaded_adapters:
            self.loaded.setdefault(key, "")
        self.info = info

    def touch(self, key: str) -> None:
        if key in self.loaded:
            self.loaded.move_to_end(key)

    async def drop_adapter(self, key: str) -> bool:
        """Drop the adapter there (once the requests using it are done); False if it did not hold it."""
        try:
            await self.call("DropAdapter", sampler_pb2.SamplerDropAdapterRequest(checkpoint_key=key))
        except TemperError as exc:
            if not AdapterNotLoaded.matches(exc):
                raise  # still counted as here: a retry asks again
            self.loaded.pop(key, None)
            return False
        self.loaded.pop(key, None)
        return True


class SamplerRouting:
    """Mixed into Backends, which provides ``settings``, ``samplers``, and ``absent`` and ``served``
    (presence.py: whether a model without samplers here is waited for or unknown)."""

    settings: SchedulerSettings
    samplers: list[SamplerHandle]
    _choices = 0

    def samplers_of(self, base_model: str) -> list[SamplerHandle]:
        found = [s for s in self.samplers if s.info.base_model == base_model]
        if not found:
            raise self.absent("sampler", base_model)  # NotFound only for a model unknown here (presence.py)
        return found

    def sampler_info(self, base_model: str) -> sampler_pb2.SamplerModelInfo:
        """The model's tokenizer, vocabulary and context length (the same on each of its samplers)."""
        return self.samplers_of(base_model)[0].info

    def holds(self, base_model: str, key: str) -> bool:
        """Whether this scheduler pushed ``key`` to a sampler of the model (and has not seen it go)."""
        return any(key in s.loaded for s in self.samplers_of(base_model))

    def sampler_for(self, base_model: str, key: str = "") -> SamplerHandle:
        """The sampler for a request on ``key`` ("" for the base model); see the module's docstring."""
        return self._choose(self.samplers_of(base_model), key)

    def _choose(self, candidates: list[SamplerHandle], key: str) -> SamplerHandle:
        now = time.monotonic()
        chosen = least = min(candidates, key=lambda s: (s.suspect(now), s.in_flight, s.chosen))
        holders = [s for s in candidates if key and key in s.loaded]
        if holders:
            holder = min(holders, key=lambda s: (s.suspect(now), s.in_flight))  # equal loads: always the same one
            slack = self.settings.sampler_affinity_slack
            if (holder.suspect(now), holder.in_flight) <= (least.suspect(now), least.in_flight + slack):
                chosen = holder
        self._choices += 1
        chosen.chosen = self._choices
        return chosen

    async def on_a_sampler(self, base_model: str, key: str, action: Callable[[SamplerHandle], Awaitable[T]] | None,
                           load: Callable[[SamplerHandle], Awaitable[None]] | None = None) -> T | None:
        """``load`` (which puts ``key``'s adapter there), then ``action``, on the sampler chosen for
        ``key``; a sampler that cannot be reached or stops answering is replaced by the next one chosen
        among those not tried yet. When every one failed, they are tried again (backing off) for
        sampler_retry_seconds: a restarting sampler completes the call late instead of failing it.
        Unavailable after that; other errors are the caller's."""
        await self.served("sampler", base_model)  # a model whose samplers are registering again waits for them
        # each attempt re-picks among all the model's samplers (their suspicion and load as they are then)
        return await retry(lambda: self._each_sampler_once(base_model, key, action, load),
                           seconds=self.settings.sampler_retry_seconds, max_delay=2.0, what="sampling")

    async def _each_sampler_once(self, base_model: str, key: str, action, load) -> T | None:
        candidates, tried, failures = self.samplers_of(base_model), [], []
        while len(tried) < len(candidates):
            sampler = self._choose([s for s in candidates if s not in tried], key)
            tried.append(sampler)
            with sampler.busy():  # chosen and counted with no await between: concurrent requests spread
                try:
                    if sampler.recheck:
                        await self.refresh_sampler(sampler)
                    if key and load is not None:
                        await load(sampler)
                    result = await action(sampler) if action is not None else None
                except (SamplerUnavailable, Abandoned) as exc:  # Abandoned: marked down while the call waited
                    sampler.failed()
                    failures.append(exc.message)
                    cluster_event("failure", exc.message, sampler.address)
                    log.warning("%s; %s", exc.message, "trying another sampler" if len(tried) < len(candidates) else "no sampler left")
                    continue
            sampler.suspect_until = 0.0
            return result
        raise Unavailable(f"no sampler of {base_model} answered: {'; '.join(failures)}")

    async def call_samplers(self, base_model: str, method: str, request,
                            load: Callable[[SamplerHandle], Awaitable[None]] | None = None):
        """A Sample or ComputeLogprobs call on the model's samplers (``on_a_sampler``); ``load`` pushes
        the request's adapter to a sampler (where it is missing, or answered "not loaded")."""
        key = request.checkpoint_key

        async def call(sampler: SamplerHandle):
            reload = (lambda: load(sampler)) if key and load is not None else None
            return await self.sample_call(sampler, method, request, reload)

        return await self.on_a_sampler(base_model, key, call, load)

    async def refresh_sampler(self, sampler: SamplerHandle) -> None:
        """Ask the sampler what it holds and which incarnation it is (``SamplerHandle.adopt``)."""
        info = await sampler.call("GetModelInfo", sampler_pb2.SamplerModelInfoRequest(), timeout=INFO_TIMEOUT_SECONDS)
        sampler.adopt(info)
        sampler.recheck = False

    async def push_checkpoint(self, trainer: CheckpointSource, sampler: SamplerHandle, key: str, tenant: str = "",
                              max_resident: int = 0) -> None:
        """Stream a checkpoint's adapter files from the trainer to the sampler, once per sampler (a key
        already there becomes its most recently used). ``max_resident`` > 0 is the tenant's limit of
        adapters on this sampler: its own least recently used ones are dropped first, never another
        tenant's. A key pushed without a tenant (at save time) counts for the first tenant that uses it."""
        if sampler.loaded.get(key, "") or (key in sampler.loaded and not tenant):
            sampler.loaded.move_to_end(key)  # the common case: no lock (a push or drop may be under way)
            return
        async with sampler.lock:
            if key in sampler.loaded:
                sampler.loaded.move_to_end(key)
                if tenant and not sampler.loaded[key]:
                    sampler.loaded[key] = tenant
                    await self._within_limit(sampler, tenant, max_resident, keep=key)
                return
            await self._within_limit(sampler, tenant, max_resident, keep=key)

            # Read whole before pushing: a trainer error (the files are gone) is then an ordinary error
            # here, not an exception inside the push's request stream (which grpc.aio does not end).
            files = [sampler_pb2.PushAdapterChunk(file=chunk) async for chunk in trainer.read_checkpoint(key, weights_only=True)]

            async def chunks():
                yield sampler_pb2.PushAdapterChunk(checkpoint_key=key)
                for chunk in files:
                    yield chunk

            async with downstream(f"pushing {key} to sampler {sampler.address}", SamplerUnavailable):
                await sampler.calls.run(sampler.stub.PushAdapter(chunks(), timeout=self.settings.sampler_call_timeout_seconds))
            sampler.loaded[key] = tenant

    @staticmethod
    async def _within_limit(sampler: SamplerHandle, tenant: str, max_resident: int, keep: str) -> None:
        """Drop the tenant's least recently used adapters until ``keep`` fits in ``max_resident`` (under sampler.lock)."""
        if max_resident <= 0:
            return
        own = [k for k, t in sampler.loaded.items() if t == tenant and k != keep]
        for victim in own[: max(len(own) - (max_resident - 1), 0)]:
            await sampler.drop_adapter(victim)
            log.info("dropped %s from sampler %s: tenant %s keeps at most %d adapters there", victim, sampler.address,
                     tenant, max_resident)

    async def sample_call(self, sampler: SamplerHandle, method: str, request,
                          reload: Callable[[], Awaitable[None]] | None = None):
        """A Sample or ComputeLogprobs call on one sampler. A sampler that no longer holds the request's
        adapter (it evicted it, or restarted) answers AdapterNotLoaded: what it holds is asked again,
        ``reload`` (which pushes the adapter again) runs and the call is retried once."""
        key = request.checkpoint_key
        sampler.touch(key)
        try:
            return await sampler.call(method, request)
        except TemperError as exc:
            if not (key and reload is not None and AdapterNotLoaded.matches(exc)):
                raise
        log.info("sampler %s no longer holds %s: pushing it again", sampler.address, key)
        await self.refresh_sampler(sampler)
        sampler.loaded.pop(key, None)
        await reload()
        return await sampler.call(method, request)

    async def forget_checkpoint(self, key: str) -> None:
        """Drop a (deleted) checkpoint's adapter from every sampler. All are asked, since a restarted
        scheduler does not know where it pushed before; one that does not hold it is fine, and one that
        cannot be reached is skipped unless this scheduler pushed the key there (then Unavailable)."""

        async def forget(sampler: SamplerHandle) -> None:
            async with sampler.lock:
                pushed = key in sampler.loaded
                try:
                    await sampler.drop_adapter(key)
                except Unavailable as exc:
                    if pushed:
                        raise
                    log.warning("could not ask sampler %s to drop %s: %s", sampler.address, key, exc.message)

        results = await asyncio.gather(*(forget(s) for s in self.samplers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
