"""Incremental detokenization that only ever emits whole UTF-8 characters, and stop strings."""

from __future__ import annotations

from frugal.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's growing list of output token ids into text, handed out in pieces.

    Decodes a sliding window [prefix, end) and adds what it adds over [prefix, read); while the
    window ends inside a multi-byte character (the decode ends in U+FFFD) it waits for more tokens.
    Decoded text waits in `unsent` until take() hands it out; with stop strings the last
    (longest stop - 1) characters stay there, so no part of a stop string is ever shown. Holds
    O(window + longest stop) characters whatever the length of the output.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stops: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._prefix = 0
        self._read = 0
        self.stops = list(stops or [])
        self._hold = max(map(len, self.stops), default=1) - 1
        self.unsent = ""

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """token_ids: every output token so far. Returns the text they add (maybe "")."""
        decode = self._tokenizer.decode
        before = decode(token_ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(token_ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(token_ids)
        self.unsent += delta
        return delta

    def find_stop(self, num_new_chars: int) -> str | None:
        """The earliest stop string ending within the last num_new_chars characters decoded; the
        text from it on is dropped. Every character a stop string could start at is unsent."""
        hit = find_stop(self.unsent, num_new_chars, self.stops)
        if hit is None:
            return None
        self.unsent = self.unsent[:hit[0]]
        return hit[1]

    def take(self, final: bool) -> str:
        """Text to hand out now: all of it when final, else all but what a stop string could
        still begin with."""
        cut = len(self.unsent) if final else max(0, len(self.unsent) - self._hold)
        out, self.unsent = self.unsent[:cut], self.unsent[cut:]
        return out


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last num_new_chars of text: (start index, stop)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
