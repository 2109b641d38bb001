"""One sequence's text as its tokens arrive (streamed sampling), equal at the end to what the
non-streamed answer shows: ``tokenizer.decode(tokens, skip_special_tokens=True)`` cut before the
first stop string (openai_convert.choices_of).

Decoding is incremental over a short window of tokens (the offsets way vLLM's detokenizer works), so
a long answer costs linear time, and text is released only when it is final:
- a window whose decoding ends in U+FFFD is held: a multi-byte character split across tokens is
  never sent half (its bytes come with a later token; a truly invalid byte is released at the end);
- text that could be the start of a stop string is held until it is not (or until the end), and a
  complete stop string ends the text before it, as OpenAI leaves the stop sequence out.
At the end the whole sequence is decoded once more: the text sent is always a prefix of it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("temper.gateway")
REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""                     # decoded so far (windows that ended cleanly)
        self.sent = 0                      # characters of ``text`` released
        self.stopped: str | None = None    # the stop string that ended the text
        self._prefix = self._read = 0      # token offsets of the decoding window

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        """Take the sequence's next tokens; returns the text that became final (often "")."""
        self.tokens.extend(tokens)
        if self.stopped is not None or not tokens:
            return ""
        before = self._decode(self.tokens[self._prefix:self._read])
        window = self._decode(self.tokens[self._prefix:])
        if len(window) > len(before) and not window.endswith(REPLACEMENT) and window.startswith(before):
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest, once the sequence has ended: held bytes and held stop-string prefixes."""
        if self.stopped is None:
            whole = self._decode(self.tokens)
            if whole.startswith(self.text):
                self.text = whole
            else:  # a tokenizer whose decoding is not prefix-stable: what was sent stands
                log.warning("incremental decoding drifted from the whole decoding; the streamed text may differ")
                tail = self._decode(self.tokens[self._prefix:])
                self.text += tail[len(self._decode(self.tokens[self._prefix:self._read])):]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped is not None:
            return ""
        text, limit = self.text, len(self.text)
        if self.stop:
            found = [(i, s) for s in self.stop if (i := text.find(s, self.sent)) >= 0]
            held = None if final else self._partial_start(text)
            if found:
                cut, which = min(found)
                if held is None or cut <= held:
                    self.stopped, limit = which, cut
                else:
                    limit = held
            elif held is not None:
                limit = held
        out = text[self.sent:limit]
        self.sent = limit
        return out

    def _partial_start(self, text: str) -> int | None:
        """Where the earliest tail of ``text`` that begins some stop string starts (None: no such tail)."""
        longest = max(len(s) for s in self.stop)
        for start in range(max(self.sent, len(text) - longest + 1), len(text)):
            tail = text[start:]
            if any(s.startswith(tail) for s in self.stop):
                return start
        return None
