"""The engine loop on its own thread, fed from asyncio: the HTTP side never blocks a step.

Callers submit through a thread-safe inbox and receive each request's outputs on an asyncio queue
of their own event loop, so a slow client only ever delays its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from frugal.engine.llm_engine import LLMEngine
from frugal.kv_cache.page_allocator import IntegrityError
from frugal.request import RequestOutput, SamplingParams
from frugal.server.metrics import Metrics

logger = logging.getLogger("frugal")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    num_prompt_tokens: int = 0


class AsyncEngine:
    """Owns an LLMEngine and the one thread that calls it."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._preemptions_seen = 0
        self._thread = threading.Thread(target=self._loop, name="frugal-engine", daemon=True)
        if metrics is not None:
            pool = engine.runner.pool
            metrics.pages_total.set(pool.num_pages)
            metrics.kv_tokens.set(pool.capacity_tokens)
            metrics.kv_ratio.set(engine.runner.kv_capacity_ratio)
            metrics.kv_info.labels(model_name=metrics.model_name, **pool.describe()).set(1)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the loop and wait for it."""
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout)

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Closing the iterator early aborts it."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), num_prompt_tokens=len(prompt))
        self._inbox.put(("add", request_id, prompt, params, sink))
        self._wakeup.set()
        if not self.alive:  # checked after queueing: a loop dying later still answers the add
            raise EngineDeadError("the engine is not running")
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._update_gauges()  # an abort frees pages at once: show it
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.1)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug: fail what is in flight, keep serving
                    logger.exception("engine step failed; aborting %d requests", len(self._sinks))
                    self._fail_all(RuntimeError(f"engine error: {e}"))
                    continue
                now = time.monotonic()
                for output in outputs:
                    self._deliver(output, now)
                self._update_gauges()
        finally:
            self._stop.set()
            dead = EngineDeadError("the engine has stopped")
            self._fail_all(dead)
            while True:  # adds queued behind the last step get the same answer
                try:
                    command, _, *rest = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    self._send(rest[2], dead)

    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; True when there were any."""
        changed = False
        while True:
            try:
                command, request_id, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command == "add":
                prompt, params, sink = rest
                try:
                    self.engine.add_request(prompt, params, request_id)
                except ValueError as e:
                    self._send(sink, e)
                    continue
                self._sinks[request_id] = sink
            elif request_id in self._sinks:
                output = self.engine.abort_request(request_id)
                sink = self._sinks.pop(request_id)
                if self.metrics is not None:
                    self.metrics.aborted.inc()
                if output is not None:
                    self._send(sink, output)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        m = self.metrics
        completion = output.outputs[0]
        if completion.finish_reason == "error":  # the server's fault: a 500 or an error event
            del self._sinks[output.request_id]
            if m is not None:
                m.errored.inc()
                m.kv_integrity_failures.inc()
            self._send(sink, IntegrityError(completion.error))
            return
        if m is not None:
            if sink.last_token is None:
                m.ttft.observe(now - sink.arrival)
            else:
                m.itl.observe(now - sink.last_token)
            m.generation_tokens.inc()
            if output.finished:
                m.e2e.observe(now - sink.arrival)
                m.prompt_tokens.inc(sink.num_prompt_tokens)
                m.finished(output.outputs[0].finish_reason)
        sink.last_token = now
        if output.finished:
            del self._sinks[output.request_id]
        self._send(sink, output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            if self.metrics is not None:
                self.metrics.errored.inc()
            self._send(sink, error)
        self._sinks.clear()
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        scheduler = self.engine.scheduler
        m.running.set(len(scheduler.running))
        m.waiting.set(len(scheduler.waiting))
        m.pages_used.set(scheduler.allocator.num_used)
        m.preemptions.inc(self.engine.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = self.engine.num_preemptions

    @staticmethod
    def _send(sink: _Sink, item: object) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone (shutdown)
            pass
