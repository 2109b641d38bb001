"""Rules for scoring a sample request's prompt (top-k prompt logprobs, the last n positions): no
protobuf here, so the sampler's torch backend stays transport-free; ``validation.py`` re-exports them."""

from __future__ import annotations

from temper.common.errors import InvalidArgument

MAX_TOPK_PROMPT_LOGPROBS = 20  # a (len(prompt), k) answer; Tinker bounds it the same way
TOPK_MASK_LOGPROB = -99999.0   # Tinker's sentinel logprob (with token id 0) for a top-k cell left empty


def check_prompt_scoring(prompt_length: int, include_prompt_logprobs: bool, topk_prompt_logprobs: int,
                         last_n: int | None) -> None:
    """The prompt-scoring options of a sample request: k in [0, MAX], and ``last_n`` (if given) in
    [1, len(prompt) - 1] on a request that scores the prompt."""
    if not 0 <= topk_prompt_logprobs <= MAX_TOPK_PROMPT_LOGPROBS:
        raise InvalidArgument(f"topk_prompt_logprobs must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}], got {topk_prompt_logprobs}")
    if last_n is None:
        return
    if not include_prompt_logprobs and not topk_prompt_logprobs:
        raise InvalidArgument("prompt_logprobs_last_n needs include_prompt_logprobs (or topk_prompt_logprobs)")
    check_last_n(prompt_length, last_n)


def check_last_n(prompt_length: int, last_n: int) -> None:
    if not 1 <= last_n <= prompt_length - 1:
        raise InvalidArgument(f"prompt_logprobs_last_n must be in [1, len(prompt) - 1] = [1, {prompt_length - 1}], "
                              f"got {last_n}")
