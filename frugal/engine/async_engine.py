"""The engine loop on its own thread, fed from asyncio: the HTTP side never blocks a step.

The server talks to AsyncEngine alone, never to the LLMEngine inside: what it reads of the engine
(tokenizer, max_model_len, tokenize, the KV connector) does not change while serving, and stats()
is the snapshot the engine thread took after its last step, safe to read from any thread.

Callers submit through a thread-safe inbox. Each step's outputs reach each caller's event loop in
one batch, and a request's outputs wait there joined into one (RequestOutput.add), so a client
that stops reading holds only what it has not read, and only its own request waits.

The loop survives any one request's failure: a rejected add, an abort or a token that raises
errors that request alone; a step that raises errors the requests in flight and the loop goes on.
It dies only when the device or the tensor-parallel group does (see watchdog): every waiting
caller gets EngineDeadError at once, `alive` turns False and on_dead is called, so the server
can exit for a supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from frugal.disagg import Unavailable
from frugal.engine.channels import Inbox, RequestFailedError, Streams
from frugal.engine.llm_engine import LLMEngine
from frugal.engine.output_stream import OutputStream, send
from frugal.engine.stats import EngineStats, StatsLog
from frugal.engine.watchdog import Watchdog
from frugal.metrics import Metrics
from frugal.request import RequestOutput, SamplingParams
from frugal.tokenizer import Tokenizer

logger = logging.getLogger("frugal")

IDLE_CHECK_S = 1.0  # idle this long before check_integrity (never in the way of a next request)
DEAD_JOIN_S = 1.0  # what shutdown waits for a dead engine's loop before killing the ranks


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class AsyncEngine:
    """Owns an LLMEngine and the one thread that calls it (plus a watchdog thread)."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None,
                 step_timeout: float | None = None,
                 on_dead: Callable[[str], None] | None = None,
                 log_stats: float | None = None) -> None:
        """log_stats: log engine.stats.StatsLog's line every that many seconds (None: never)."""
        self.engine = engine
        self.metrics = metrics
        self.step_timeout = step_timeout
        self.on_dead = on_dead
        self.dead: str | None = None  # why the engine died
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len: int = engine.max_model_len  # prompt + output tokens, at most
        self._inbox = Inbox()
        self._streams = Streams(metrics)
        self._stop = threading.Event()
        self._stats = engine.stats()  # (the loop has not started: no step can race this one)
        self._stats_log = StatsLog(log_stats) if log_stats else None
        self._thread = threading.Thread(target=self._loop, name="frugal-engine", daemon=True)
        self._watchdog = Watchdog(engine, self._die, self._stop, step_timeout)
        if metrics is not None:
            metrics.watch(self._stats)

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def connector(self):
        """The engine's KV connector to other workers (disagg.connector; with --kv-role a
        NixlConnector, whose `signer` and signed `metadata` the side channel serves; its role
        None without)."""
        return self.engine.connector

    def stats(self) -> EngineStats:
        """The engine's stats after its last step, drain or integrity check (any thread; the
        LLMEngine's own stats() may be called only where no step runs)."""
        return self._stats

    def tokenize(self, prompt: str | list[int], max_tokens: int | None = None) -> list[int]:
        """(any thread) LLMEngine.tokenize: a prompt's token ids; ValueError when it is not
        valid (ids out of the vocabulary, or more than max_tokens tokens)."""
        return self.engine.tokenize(prompt, max_tokens)

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet running (in the inbox or the waiting queue)."""
        return self._inbox.num_queued

    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()  # (a lost rank is its to notice, with or without step_timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (what is left gets EngineDeadError), wait for it (a dead engine's loop
        DEAD_JOIN_S at most: it is done, or stuck in a step) and close the engine. Returns with
        no tensor-parallel rank process left, even when a step never returned."""
        self._stop.set()
        self._inbox.wake()
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
        self._inbox.put(("fail_all", error))

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       kv_transfer: dict | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes: each holds what is new since the previous
        one (several steps' worth when the caller was slow). Closing the iterator early, or
        cancelling it, aborts the request. kv_transfer, cache_salt: see
        LLMEngine.add_request."""
        stream = OutputStream(asyncio.get_running_loop(), len(prompt))
        self._inbox.put(("add", request_id, prompt, params, stream, kv_transfer, cache_salt))
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
        self._inbox.put(("abort", request_id))

    # -- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        idle_since, checked = time.monotonic(), False
        try:
            while not self._stop.is_set():
                if self._drain_inbox():
                    self._update_gauges()  # an abort frees pages at once: show it
                if not self.engine.has_unfinished_requests():
                    held = self.engine.holds_pages
                    try:
                        self._streams.deliver(self.engine.poll_transfers())  # a prefill's leases
                    except Exception:
                        logger.exception("polling KV transfers failed")
                    if held:
                        self._update_gauges()
                    self._log_stats()  # (the interval that ends idle)
                    if idle_since is None:
                        idle_since = time.monotonic()
                    elif not checked and time.monotonic() - idle_since > IDLE_CHECK_S:
                        self._check_integrity()
                        checked = True
                    # Pages held for a decode worker: poll often, as the read needs this
                    # side's progress (see disagg.nixl).
                    self._inbox.wait(0.001 if self.engine.holds_pages else 0.1)
                    continue
                idle_since, checked = None, False
                try:
                    with self._watchdog.step():
                        outputs = self.engine.step()
                except Exception as e:
                    self._step_failed(e)
                    continue
                if self._stop.is_set():  # the watchdog gave up on this step meanwhile
                    break
                self._streams.deliver(outputs)
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
            self._streams.fail_all(error)
            # adds queued behind the last step get the same answer
            for command, *rest in self._inbox.take():
                if command == "add":
                    send([(rest[3], error)])

    def _drain_inbox(self) -> bool:
        """Apply queued adds, aborts and fail_alls; True when there were any."""
        changed = False
        for command, *rest in self._inbox.take():
            changed = True
            if command == "add":
                self._add(*rest)
            elif command == "abort":
                self._abort(rest[0])
            else:
                self._fail_all(rest[0])
        return changed

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams,
             stream: OutputStream, kv_transfer: dict | None, cache_salt: str | None) -> None:
        try:
            self.engine.add_request(prompt, params, request_id, kv_transfer, cache_salt)
        except (ValueError, Unavailable) as e:  # the client's fault (a 400), or a 503
            send([(stream, e)])
            return
        except Exception as e:  # a bug, but this request's alone
            logger.exception("adding request %s failed", request_id)
            self._streams.fail(stream, RequestFailedError(f"engine error: {e}"))
            return
        self._streams.add(request_id, stream)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id)
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
        """(called in the except clause, so that its log carries the traceback)"""
        if self.dead is not None:  # the watchdog gave up on this step: it failed everything
            return
        reason = self._watchdog.fatal(error)
        if reason is not None:
            self._die(reason)
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
        self._streams.fail_all(error)
        self._update_gauges()

    def _die(self, reason: str) -> None:
        """(either thread) Mark the engine dead and answer every caller at once."""
        if self.dead is not None:
            return
        self.dead = reason
        self._stop.set()
        self._inbox.wake()
        logger.critical("engine dead: %s", reason)
        self._streams.fail_all(EngineDeadError(f"engine dead: {reason}"))
        if self.on_dead is not None:
            self.on_dead(reason)

    def _check_integrity(self) -> None:
        self.engine.check_integrity()
        if self.metrics is not None:
            self.metrics.bookkeeping_checks.inc()
        self._update_gauges()

    def _update_gauges(self) -> None:
        stats = self._stats = self.engine.stats()  # (one reference: read whole or not at all)
        self._inbox.num_waiting = stats.num_waiting
        if self.metrics is not None:
            self.metrics.update(stats)
        self._log_stats()

    def _log_stats(self) -> None:
        line = self._stats_log and self._stats_log.line(self._stats)
        if line:
            logger.info(line)
