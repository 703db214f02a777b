"""The engine loop on its own thread, fed from asyncio: the HTTP side never blocks a step.

Callers submit through a thread-safe inbox. Each step's outputs reach each caller's event loop in
one batch, and a request's outputs wait there joined into one (RequestOutput.add), so a client
that stops reading holds only what it has not read, and only its own request waits.

The loop survives any one request's failure: a rejected add, an abort or a token that raises
errors that request alone; a step that raises errors the requests in flight and the loop goes on.
It dies only when the device does (a step raises and the device fails a probe, or a step has not
returned within step_timeout) or the tensor-parallel group does (a rank's process exited, seen by
the watchdog within WATCH_S even while idle, or a step's collective failed): every waiting
caller gets EngineDeadError at once, `alive` turns False and on_dead is called, so the server
can exit for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from frugal.disagg import HeldPagesFull
from frugal.engine.llm_engine import LLMEngine
from frugal.engine.output_stream import OutputStream, send
from frugal.metrics import Metrics
from frugal.request import RequestOutput, SamplingParams

logger = logging.getLogger("frugal")

IDLE_CHECK_S = 1.0  # idle this long before check_integrity (never in the way of a next request)
WATCH_S = 1.0  # how often the watchdog looks (at most) for a hung step or a lost rank
DEAD_JOIN_S = 1.0  # what shutdown waits for a dead engine's loop before killing the ranks


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its KV pages failed the integrity check, or a bug)."""


@dataclass
class _Counts:
    """Counters written by one thread each and read by the other."""

    submitted: int = 0  # adds put in the inbox (event loop side)
    drained: int = 0  # adds taken out of it (engine side)
    waiting: int = 0  # the scheduler's waiting queue after the last step


class AsyncEngine:
    """Owns an LLMEngine and the one thread that calls it (plus a watchdog thread)."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None,
                 step_timeout: float | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.step_timeout = step_timeout
        self.on_dead = on_dead
        self.dead: str | None = None  # why the engine died
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards _streams (the watchdog fails them too)
        self._streams: dict[str, OutputStream] = {}
        self._stop = threading.Event()
        self._counts = _Counts()
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._loop, name="frugal-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="frugal-watchdog",
                                          daemon=True)
        if metrics is not None:
            metrics.watch(engine.stats())

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet running (in the inbox or the waiting queue)."""
        c = self._counts
        return c.submitted - c.drained + c.waiting

    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()  # (a lost rank is its to notice, with or without step_timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (what is left gets EngineDeadError), wait for it (a dead engine's loop
        DEAD_JOIN_S at most: it is done, or stuck in a step) and close the engine. Returns with
        no tensor-parallel rank process left, even when a step never returned."""
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():  # (a dead engine's loop is done, or stuck in a step)
            self._thread.join(timeout if self.dead is None else min(timeout, DEAD_JOIN_S))
        if self._thread.is_alive():
            # inside a step that never returned: kill the tensor-parallel ranks, so that none
            # outlives the server (and their collective fails, freeing the loop: not on NCCL)
            self.engine.close(leave=False)
            self._thread.join(timeout)
        if not self._thread.is_alive():  # (the loop is done with the engine)
            self.engine.close()

    def fail_all(self, error: BaseException) -> None:
        """Error every request in flight (e.g. a shutdown past its grace time); the loop goes on."""
        self._put(("fail_all", error))

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       kv_transfer: dict | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes: each holds what is new since the previous
        one (several steps' worth when the caller was slow). Closing the iterator early, or
        cancelling it, aborts the request. kv_transfer, cache_salt: see
        LLMEngine.add_request."""
        stream = OutputStream(asyncio.get_running_loop(), len(prompt))
        self._counts.submitted += 1
        self._put(("add", request_id, prompt, params, stream, kv_transfer, cache_salt))
        if not self.alive:  # checked after queueing: a loop dying later still answers the add
            raise EngineDeadError(self.dead or "the engine is not running")
        finished = False
        try:
            while not finished:
                try:
                    output = await stream.get()
                except Exception:  # its terminal error: the engine side already dropped it
                    finished = True
                    raise
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    def _put(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        idle_since, checked = time.monotonic(), False
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._update_gauges()  # an abort frees pages at once: show it
                if not self.engine.has_unfinished_requests():
                    held = bool(self.engine.scheduler.held)
                    try:
                        self._deliver(self.engine.poll_transfers())  # a prefill's leases
                    except Exception:
                        logger.exception("polling KV transfers failed")
                    if held:
                        self._update_gauges()
                    if idle_since is None:
                        idle_since = time.monotonic()
                    elif not checked and time.monotonic() - idle_since > IDLE_CHECK_S:
                        self._check_integrity()
                        checked = True
                    # Pages held for a decode worker: poll often, as the read needs this
                    # side's progress (see disagg.kv_transfer).
                    self._wakeup.wait(0.001 if self.engine.scheduler.held else 0.1)
                    self._wakeup.clear()
                    continue
                idle_since, checked = None, False
                self._step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    self._step_started = None
                    self._step_failed(e)
                    continue
                self._step_started = None
                if self._stop.is_set():  # the watchdog gave up on this step meanwhile
                    break
                self._deliver(outputs)
                self._update_gauges()
        except BaseException as e:  # a bug in the loop itself
            logger.exception("the engine loop crashed")
            self._die(f"the engine loop crashed: {e!r}")
        finally:
            self._stop.set()
            error = EngineDeadError(self.dead or "the engine has stopped")
            if self.dead is None:  # a clean stop leaves the engine empty, its pages free
                try:
                    self.engine.fail_all(str(error))
                except Exception:
                    logger.exception("emptying the engine at shutdown failed")
            self._fail_streams(error)
            while True:  # adds queued behind the last step get the same answer
                try:
                    command, *rest = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    send([(rest[3], error)])

    def _drain_inbox(self) -> bool:
        """Apply queued adds, aborts and fail_alls; True when there were any."""
        changed = False
        while True:
            try:
                command, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command == "add":
                self._add(*rest)
            elif command == "abort":
                self._abort(rest[0])
            else:
                self._fail_all(rest[0])

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams,
             stream: OutputStream, kv_transfer: dict | None, cache_salt: str | None) -> None:
        self._counts.drained += 1
        try:
            self.engine.add_request(prompt, params, request_id, kv_transfer, cache_salt)
        except (ValueError, HeldPagesFull) as e:  # the client's fault (a 400), or a 503
            send([(stream, e)])
            return
        except Exception as e:  # a bug, but this request's alone
            logger.exception("adding request %s failed", request_id)
            self._count_error()
            send([(stream, RequestFailedError(f"engine error: {e}"))])
            return
        with self._lock:
            self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if self.metrics is not None:
            self.metrics.aborted.inc()
        try:
            output = self.engine.abort_request(request_id)
        except Exception:  # the caller is gone anyway; the request ends when it ends
            logger.exception("aborting request %s failed", request_id)
            return
        if output is not None:
            send([(stream, output)])

    def _step_failed(self, error: Exception) -> None:
        if self.dead is not None:  # the watchdog gave up on this step: it failed everything
            return
        lost = self.engine.lost_rank(error)
        if lost is not None:  # the other ranks' half of the step is gone: no step can run
            logger.error("engine step failed: %r", error)
            self._die(lost)
            return
        if not self.engine.runner.device_ok():
            logger.exception("engine step failed and the device does not answer")
            self._die(f"the device failed: {error!r}")
            return
        logger.exception("engine step failed; failing the %d requests in flight",
                         len(self._streams))
        self._fail_all(RequestFailedError(f"engine error: {error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        try:
            self.engine.fail_all(str(error))
        except Exception as e:  # the engine cannot even be emptied: nothing can be trusted
            logger.exception("failing the requests in flight failed")
            self._die(f"the engine could not recover from an error: {e!r}")
            return
        self._fail_streams(error)
        self._update_gauges()

    def _fail_streams(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for _ in streams:
            self._count_error()
        send([(s, error) for s in streams])

    def _die(self, reason: str) -> None:
        """(either thread) Mark the engine dead and answer every caller at once."""
        if self.dead is not None:
            return
        self.dead = reason
        self._stop.set()
        self._wakeup.set()
        logger.critical("engine dead: %s", reason)
        self._fail_streams(EngineDeadError(f"engine dead: {reason}"))
        if self.on_dead is not None:
            self.on_dead(reason)

    def _watch(self) -> None:
        """(the watchdog thread) Die when a step has not returned within step_timeout (if set)
        or a tensor-parallel rank's process is gone: while idle nothing else would notice, and
        a rank that hangs rather than exits holds a step until step_timeout."""
        timeout = self.step_timeout
        while not self._stop.wait(WATCH_S if timeout is None else min(WATCH_S, timeout / 4)):
            started = self._step_started
            if timeout is not None and started is not None and \
                    time.monotonic() - started > timeout:
                self._die(f"a step has not returned in {timeout:g} s")
            lost = self.engine.lost_rank()
            if lost is not None:
                self._die(lost)

    def _check_integrity(self) -> None:
        self.engine.check_integrity()
        if self.metrics is not None:
            self.metrics.bookkeeping_checks.inc()
        self._update_gauges()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
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

    def _count_error(self) -> None:
        if self.metrics is not None:
            self.metrics.errored.inc()

    def _update_gauges(self) -> None:
        stats = self.engine.stats()
        self._counts.waiting = stats.num_waiting
        if self.metrics is not None:
            self.metrics.update(stats)
