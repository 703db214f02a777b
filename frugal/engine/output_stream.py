"""A request's outputs on its caller's event loop, handed over from the engine thread.

The engine thread calls send() once a step with every output it produced: one call into each
event loop. There each OutputStream joins what its reader has not taken yet into one output
(RequestOutput.add), so a reader that stalls holds O(unread tokens), never a queue of copies.
"""

from __future__ import annotations

import asyncio
import time

from frugal.request import RequestOutput


class OutputStream:
    """One request's outputs on its caller's event loop: what arrived and was not yet read,
    joined into one output (so O(unread tokens) memory), and a terminal error if any."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_prompt_tokens: int) -> None:
        self.loop = loop
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """(event loop thread)"""
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending.add(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """Everything that arrived since the last get, joined; raises the terminal error once
        nothing else is left."""
        await self._ready.wait()
        item, self._pending = self._pending, None
        if item is None:
            raise self._error
        if self._error is None:
            self._ready.clear()
        return item


def send(items: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    """Hand items to their streams: one call into each event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the caller's event loop is gone (shutdown)
            pass


def _put_all(batch: list[tuple[OutputStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)
