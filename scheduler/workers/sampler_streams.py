"""Streamed sampling (SampleStream) on the model's samplers, chosen and failed over as Sample is
(``samplers.SamplerRouting.on_a_sampler``), with one difference: a stream is moved to another sampler
only until its first message. Once the caller has pieces, a sampler that stops answering ends the
stream with Unavailable (sampling it again elsewhere would send a second, different answer).

The sampler counts as busy (its load, for the choice of later requests) until its stream ends.
"""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

import grpc

from temper.common.errors import AdapterNotLoaded, TemperError, Unavailable
from temper.scheduler.workers.downstream import downstream
from temper.scheduler.workers.samplers import SamplerHandle, SamplerRouting, SamplerUnavailable
from temper.v1 import sampler_pb2, types_pb2

Load = Callable[[SamplerHandle], Awaitable[None]]


async def stream_on_a_sampler(routing: SamplerRouting, base_model: str, request: sampler_pb2.SamplerSampleRequest,
                              load: Load | None = None) -> AsyncIterator[types_pb2.SampleStreamChunk]:
    """The sampler's SampleStream messages, the done one last. ``load`` pushes the request's adapter to
    a sampler (where it is missing, or answered "not loaded")."""
    key = request.checkpoint_key

    async def open_on(sampler: SamplerHandle):
        reload = (lambda: load(sampler)) if key and load is not None else None
        return sampler, *await _open(routing, sampler, request, reload)

    sampler, call, first = await routing.on_a_sampler(base_model, key, open_on, load)
    try:
        with sampler.busy():
            chunk = first
            while True:
                yield chunk
                if chunk.done:
                    return
                async with downstream(f"sampler {sampler.address} (mid-stream)", SamplerUnavailable):
                    chunk = await sampler.calls.run(call.read())  # Abandoned when it is marked down
                if chunk is grpc.aio.EOF:
                    raise Unavailable(f"sampler {sampler.address} ended the stream before its last message")
    finally:
        call.cancel()  # the caller left (or it failed): the sampler stops sending


async def _open(routing: SamplerRouting, sampler: SamplerHandle, request, reload: Callable[[], Awaitable[None]] | None):
    """(the call, its first message) on one sampler. An answer "not loaded" before the first message
    asks what the sampler holds, pushes the adapter again and opens once more (samplers.sample_call)."""
    sampler.touch(request.checkpoint_key)
    for attempt in range(2):
        call = sampler.stub.SampleStream(request, timeout=sampler.settings.sampler_call_timeout_seconds)
        try:
            async with downstream(f"sampler {sampler.address}", SamplerUnavailable):
                first = await sampler.calls.run(call.read())
        except TemperError as exc:
            call.cancel()
            if attempt or reload is None or not AdapterNotLoaded.matches(exc):
                raise
            await routing.refresh_sampler(sampler)
            sampler.loaded.pop(request.checkpoint_key, None)
            await reload()
            continue
        if first is grpc.aio.EOF:
            raise SamplerUnavailable(f"sampler {sampler.address} ended the stream before its first message")
        return call, first
    raise AssertionError("unreachable")
