"""Streamed sampling for the HTTP routes (OpenAI's and Anthropic's ``stream: true``): the scheduler's
SampleStream messages as per-sequence text deltas, decoded incrementally (detokenize.py).

``open_deltas`` opens the stream and waits for its first message, so a refused request (auth, limits,
validation, an unknown model) fails before the route starts its answer and gets a proper HTTP error;
after that, each message becomes deltas as soon as it arrives. A sequence's last delta says why it
ended, as the non-streamed answer does: "stop" (a stop token, or a stop string cut from the text) or
"length".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from temper.common.codec import decode_floats, decode_tokens
from temper.services.gateway.detokenize import TextStream
from temper.services.gateway.upstream import Scheduler
from temper.v1 import service_pb2, types_pb2


@dataclass
class Delta:
    """What one sequence gained in one message."""

    index: int                      # the sequence, 0 .. num_samples - 1
    text: str
    tokens: list[int]
    logprobs: list[float]
    topk: list[list[tuple[int, float]]] | None = None   # per token: the k most likely (id, logprob)
    finish_reason: str | None = None                    # "stop" | "length" on the sequence's last delta
    stop_sequence: str | None = None                    # the stop string that ended it, if one did


async def open_deltas(scheduler: Scheduler, key: str, request: service_pb2.SampleRequest, tokenizer: Any,
                      stop: tuple[str, ...]) -> AsyncIterator[list[Delta]]:
    """Opens SampleStream (raising GatewayError if it is refused); returns the deltas of each message."""
    messages = await scheduler.open_stream("SampleStream", request, key)
    return _deltas(messages, tokenizer, stop, request.num_samples)


async def _deltas(messages: AsyncIterator[types_pb2.SampleStreamChunk], tokenizer: Any, stop: tuple[str, ...],
                  n: int) -> AsyncIterator[list[Delta]]:
    texts = [TextStream(tokenizer, stop) for _ in range(n)]
    try:
        async for chunk in messages:
            out = [_delta(p, texts[p.index]) for p in chunk.pieces if p.index < n]
            if out:
                yield out
            if chunk.done:
                return
    finally:
        await messages.aclose()


def _delta(piece: types_pb2.SampledPiece, text: TextStream) -> Delta:
    tokens = decode_tokens(piece.tokens).tolist()
    topk = None
    if piece.topk:
        ids = decode_tokens(piece.topk_token_ids).reshape(-1, piece.topk).tolist()
        lps = decode_floats(piece.topk_logprobs).reshape(-1, piece.topk).tolist()
        topk = [list(zip(i, lp)) for i, lp in zip(ids, lps)]
    delta = Delta(piece.index, text.push(tokens), tokens, decode_floats(piece.logprobs).tolist(), topk)
    if piece.stop_reason != types_pb2.STOP_REASON_UNSPECIFIED:
        delta.text += text.finish()
        cut = text.stopped is not None
        delta.finish_reason = "stop" if cut or piece.stop_reason == types_pb2.STOP_REASON_STOP else "length"
        delta.stop_sequence = text.stopped
    return delta
