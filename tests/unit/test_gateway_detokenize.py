"""Incremental detokenizing of streamed tokens (services/gateway/detokenize.py): token by token, the
text released joins to exactly the non-streamed text (decode, then cut before the first stop string),
never sends half a multi-byte character and never sends a stop string or text past it."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from temper.services.gateway.detokenize import REPLACEMENT, TextStream
from temper.services.gateway.openai_convert import _cut_at_stop


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def streamed(tokenizer, tokens, stop=(), step=1):
    text = TextStream(tokenizer, stop)
    pieces = [text.push(tokens[i:i + step]) for i in range(0, len(tokens), step)]
    return pieces + [text.finish()], text


def whole(tokenizer, tokens, stop=()):
    return _cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), tuple(stop))[0]


def test_multi_byte_characters_are_never_split(tokenizer):
    tokens = tokenizer.encode("naïve café € 😀 — done", add_special_tokens=False)
    assert len(tokens) > len("naïve café € 😀 — done".encode()) // 2  # bytes of a character span tokens here
    pieces, _ = streamed(tokenizer, tokens)
    assert "".join(pieces) == "naïve café € 😀 — done"
    assert all(REPLACEMENT not in p for p in pieces)
    assert "😀" in pieces or any("😀" in p for p in pieces)  # whole, in one piece


@pytest.mark.parametrize("seed", range(6))
def test_random_tokens_join_to_the_whole_decoding(tokenizer, seed):
    """Random ids of a byte-level vocabulary: invalid bytes, specials, characters split anywhere."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, len(tokenizer), 60).tolist()
    for step in (1, 3):
        pieces, _ = streamed(tokenizer, tokens, step=step)
        assert "".join(pieces) == whole(tokenizer, tokens)


@pytest.mark.parametrize("stop", [("fox",), ("o",), ("jumps over", "brown"), ("lazy dog.", "z"), ("nowhere",)])
def test_stop_strings_cut_as_the_non_streamed_text_does(tokenizer, stop):
    sentence = "The quick brown fox jumps over the lazy dog."
    tokens = tokenizer.encode(sentence, add_special_tokens=False)
    pieces, text = streamed(tokenizer, tokens, stop)
    assert "".join(pieces) == whole(tokenizer, tokens, stop)
    assert all(s not in "".join(pieces) for s in stop)
    assert text.stopped == (min((sentence.find(s), s) for s in stop if s in sentence)[1]
                            if any(s in sentence for s in stop) else None)


def test_a_stop_string_prefix_is_held_until_it_is_not_one(tokenizer):
    text = TextStream(tokenizer, ("END",))
    assert text.push(tokenizer.encode("ab E", add_special_tokens=False)) == "ab "
    assert text.push(tokenizer.encode("N", add_special_tokens=False)) == ""       # "EN": still maybe "END"
    assert text.push(tokenizer.encode("x", add_special_tokens=False)) == "ENx"    # not a stop: released
    assert text.push(tokenizer.encode(" END more", add_special_tokens=False)) == " "
    assert text.stopped == "END" and text.finish() == ""
