"""What passes between the callers' event loops and the engine thread: commands in, outputs out.

Inbox: any thread puts a command (add, abort, fail_all) and wakes the engine thread, which alone
takes them, all at once between steps. Each of its counters has one writer thread, so
num_queued needs no lock (a reading one step stale is fine: it only gates admission).

Streams: the engine thread registers a request's OutputStream once its add succeeded, hands it
the request's outputs after each step and drops it when the request ends. A failed step fails
every stream at once, and so does the engine's death, which the watchdog's thread may find:
hence the lock, under which a stream is dropped exactly once (delivered its last output, or
failed, never both). Every request that errors is counted once in metrics.errored; every output
delivered is observed (latency histograms) as it leaves.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from frugal.engine.output_stream import OutputStream, send
from frugal.metrics import Metrics
from frugal.request import RequestOutput


class RequestFailedError(RuntimeError):
    """The engine failed this request (its KV pages failed the integrity check, or a bug)."""


class Inbox:
    """Commands to the engine thread: tuples whose first item names them ("add", ...)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.num_put = 0  # adds put (the callers' side)
        self.num_taken = 0  # adds taken (the engine thread)
        self.num_waiting = 0  # the scheduler's waiting queue after the last step (engine thread)

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet running (in the inbox or the waiting queue)."""
        return self.num_put - self.num_taken + self.num_waiting

    def put(self, command: tuple) -> None:
        """(any thread)"""
        if command[0] == "add":
            self.num_put += 1
        self._queue.put(command)
        self._wakeup.set()

    def wake(self) -> None:
        """(any thread) End the engine thread's wait() now (e.g. to stop)."""
        self._wakeup.set()

    def wait(self, timeout: float) -> None:
        """(the engine thread) Sleep until a command arrives, wake() or timeout seconds."""
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def take(self) -> Iterator[tuple]:
        """(the engine thread) The commands queued, oldest first, until none is left."""
        while True:
            try:
                command = self._queue.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self.num_taken += 1
            yield command


class Streams:
    """OutputStreams of the requests in the engine, by request id (thread-safe)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, stream: OutputStream) -> None:
        with self._lock:
            self._streams[request_id] = stream

    def pop(self, request_id: str) -> OutputStream | None:
        """Drop a request's stream (an abort); None when it ended or failed already."""
        with self._lock:
            return self._streams.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (one call into each event loop); a finished
        request's stream is dropped, an output that finished with "error" reaches its caller
        as RequestFailedError. Outputs of requests with no stream (aborted) are dropped."""
        now, m, batch = time.monotonic(), self.metrics, []
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                completion = output.outputs[0]
                if output.finished:
                    del self._streams[output.request_id]
                if completion.finish_reason == "error":  # the server's: a 500 or an error event
                    self._count_error()
                    batch.append((stream, RequestFailedError(completion.error)))
                    continue
                if m is not None:
                    m.observe(output, stream.arrival, stream.last_token, now,
                              stream.num_prompt_tokens)
                stream.last_token = now
                batch.append((stream, output))
        send(batch)

    def fail(self, stream: OutputStream, error: BaseException) -> None:
        """Error a request the engine never took (its stream was not added), counted."""
        self._count_error()
        send([(stream, error)])

    def fail_all(self, error: BaseException) -> None:
        """Error and drop every stream (either thread)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for _ in streams:
            self._count_error()
        send([(s, error) for s in streams])

    def _count_error(self) -> None:
        if self.metrics is not None:
            self.metrics.errored.inc()
