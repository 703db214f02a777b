"""Incremental detokenization that only ever emits whole UTF-8 characters, and stop strings."""

from __future__ import annotations

from frugal.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text.

    Decodes a sliding window [prefix, end) and emits what it adds over [prefix, read); while the
    window ends inside a multi-byte character (the decode ends in U+FFFD) it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._prefix = 0
        self._read = 0
        self.text = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """token_ids: every output token so far. Returns the text they add (maybe "")."""
        decode = self._tokenizer.decode
        before = decode(token_ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(token_ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(token_ids)
        self.text += delta
        return delta


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last num_new_chars of text: (start index, stop)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
