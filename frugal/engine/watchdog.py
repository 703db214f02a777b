"""When the engine loop must die: the watchdog thread, and the verdict on a step that raised.

The engine dies only when no later step could run: the device fails (a step raises and the
device fails a probe, or a step has not returned within step_timeout) or the tensor-parallel
group does (a rank's process exited, or a step's collective failed). The engine thread cannot
see some of these itself (it is stuck in the step, or asleep while idle), so a thread of its own
looks every WATCH_S at most. Either way the verdict is a reason, handed to `die` (AsyncEngine's:
every caller gets EngineDeadError at once); the engine's own state is never touched here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from frugal.engine.llm_engine import LLMEngine

logger = logging.getLogger("frugal")

WATCH_S = 1.0  # how often the watchdog looks (at most) for a hung step or a lost rank


class Watchdog:
    """Calls die(reason) from its own thread when the step in progress (see step()) has run
    longer than step_timeout (if set), or a rank's process is gone; stops once `stop` is set.
    die may be called more than once: it must be idempotent."""

    def __init__(self, engine: LLMEngine, die: Callable[[str], None], stop: threading.Event,
                 step_timeout: float | None = None) -> None:
        self.engine = engine
        self.die = die
        self.stop = stop
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # (written by the engine thread only)
        self._thread = threading.Thread(target=self._watch, name="frugal-watchdog",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    @contextmanager
    def step(self) -> Iterator[None]:
        """(the engine thread) Around one engine step: the time step_timeout bounds."""
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None

    def fatal(self, error: Exception) -> str | None:
        """(the engine thread, in the except clause: the log carries the traceback) Why a step
        that raised `error` leaves no later step able to run (the other ranks' half of it is
        gone, or the device fails a probe), logged; None when the failure is that step's alone."""
        lost = self.engine.lost_rank(error)
        if lost is not None:
            logger.error("engine step failed: %r", error)
            return lost
        if not self.engine.runner.device_ok():
            logger.exception("engine step failed and the device does not answer")
            return f"the device failed: {error!r}"
        return None

    def _watch(self) -> None:
        """(the watchdog thread) While idle nothing else would notice a lost rank, and a rank
        that hangs rather than exits holds a step until step_timeout."""
        timeout = self.step_timeout
        while not self.stop.wait(WATCH_S if timeout is None else min(WATCH_S, timeout / 4)):
            started = self._step_started
            if timeout is not None and started is not None and \
                    time.monotonic() - started > timeout:
                self.die(f"a step has not returned in {timeout:g} s")
            lost = self.engine.lost_rank()
            if lost is not None:
                self.die(lost)
