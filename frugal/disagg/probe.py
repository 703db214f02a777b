"""Which way a KV hand-off between two workers goes, found before the first one.

A decode worker READs a small buffer (PROBE_BYTES) that a prefill worker registered beside its
pool, the first time it meets that worker, and reports the route UCX chose for the read and
the bandwidth it got. UCX tells its choice only in its log (disagg.ucx_log). A peer whose pool
maps here (disagg.direct) is probed by copying its buffer through the mapping.

A route through TCP or through host memory (VRAM pools) is slow: a loud warning, a metric,
and with --kv-require-fast-path a refusal of the peer's hand-offs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from frugal.disagg.ucx_log import PROBE_BYTES, flush, log_size, transports
from frugal.worker.kv_pool import host_shared_zeros

logger = logging.getLogger("frugal")

SPIN_S = 0.05  # how long starting a probe waits for its end (8 MiB at 0.17 GB/s or more)
SLOW_VRAM_GB_PER_S = 10.0  # below this a VRAM route UCX did not name counts as slow
_SHARED_MEMORY = ("cma", "sysv", "posix", "xpmem", "knem", "self", "memfd")

@dataclass(frozen=True)
class Route:
    """A probe's finding: the peer's engine_id and where it is, transports UCX named (empty:
    it named none; a mapped peer's: "cuda_ipc" or "memfd"), the local pool's memory ("DRAM" /
    "VRAM"), GB/s of the probe read (0 if it did not end), whether its bytes arrived as sent,
    what went wrong (None: it ended), whether the peer's pool is mapped here (disagg.direct:
    this worker copies its pages) rather than read through NIXL."""

    engine_id: str
    where: str
    transports: frozenset[str]
    mem_type: str
    gb_per_s: float
    intact: bool
    error: str | None = None
    mapped: bool = False

    @property
    def kind(self) -> str:
        t, vram = self.transports, self.mem_type == "VRAM"
        if "tcp" in t:
            return "TCP"
        if vram and "cuda_copy" in t:
            return "a bounce through host memory"
        if "cuda_ipc" in t:
            return "CUDA IPC"
        if any(x.startswith(("rc", "dc", "ud", "gga")) for x in t):
            return "RDMA"
        if t and all(x in _SHARED_MEMORY for x in t):
            return "shared memory"
        return ", ".join(sorted(t)) if t else "a transport UCX did not name"

    @property
    def slow(self) -> bool:
        kind = self.kind
        if self.error or not self.intact or kind in ("TCP", "a bounce through host memory"):
            return True
        return not self.transports and self.mem_type == "VRAM" and \
            self.gb_per_s < SLOW_VRAM_GB_PER_S

    def describe(self) -> str:
        if self.error:
            return f"KV hand-offs from {self.where}: the probe read failed ({self.error})"
        what = "" if self.intact else ", its bytes arrived changed"
        named = f" ({', '.join(sorted(self.transports))})" if self.transports else ""
        by = ", its pool mapped here" if self.mapped else ", through NIXL"
        return (f"KV hand-offs from {self.where} go over {self.kind}{named}{by}: "
                f"{self.gb_per_s:.2f} GB/s for a {PROBE_BYTES >> 20} MiB probe{what}")


@dataclass
class _Flight:
    engine_id: str
    where: str
    sha256: str  # of the bytes the peer sent
    handle: object
    lists: list  # the prepared descriptor lists (released with the read)
    started: float
    log_offset: int  # of the UCX log when it started
    error: str | None
    ended: float | None = None  # when it was seen done
    through: str | None = None  # a mapped peer's transport (start_mapped): no NIXL read
    events: tuple = ()  # a GPU copy's (begin, end) CUDA events


def sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()


class Prober:
    """One NIXL agent's probe buffer, 2 * PROBE_BYTES on its pool's device, registered with the
    agent: [0, PROBE_BYTES) random bytes peers read (address, sha256 in its metadata), the
    rest the place this agent's own probe reads land. One probe read at a time, and none while
    a read given up is not yet released (it could still land there). Never raises: what goes
    wrong is the Route's error. shareable: on a CPU, the buffer lives in a memory file (memfd)
    that peers on this host may map (disagg.direct)."""

    def __init__(self, agent, name: str, device: torch.device, mem_type: str, device_id: int,
                 ucx_log: str | None, shareable: bool = False) -> None:
        self.agent, self.name, self.ucx_log = agent, name, ucx_log
        self.mem_type, self.device_id = mem_type, device_id
        self.memfd: int | None = None
        if shareable and device.type == "cpu":
            self.memfd, self.buffer = host_shared_zeros(2 * PROBE_BYTES)
            weakref.finalize(self, os.close, self.memfd)
            self.buffer.random_(0, 256)
        else:
            self.buffer = torch.randint(0, 256, (2 * PROBE_BYTES,), dtype=torch.uint8,
                                        device=device)
        self.sha256 = sha256(self.buffer[:PROBE_BYTES])
        self._registered = agent.register_memory(self.buffer)
        self._flight: _Flight | None = None
        self._stuck: _Flight | None = None  # a read given up that NIXL has not released yet

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def busy(self) -> bool:
        return self._flight is not None or (self._stuck is not None and not self._release(
            self._stuck))

    def start(self, engine_id: str, where: str, agent: str, address: int, device_id: int,
              mem_type: str, sent_sha256: str) -> None:
        """Start reading PROBE_BYTES at address of the peer (NIXL's name `agent`), spinning
        up to SPIN_S for its end (a fast route is timed exactly, and before any other read of
        that peer can log its own table)."""
        if self.busy:
            raise RuntimeError("a probe read is in flight")
        flush()
        f = _Flight(engine_id, where, sent_sha256, None, [], 0.0, log_size(self.ucx_log), None)
        self._flight = f
        try:
            here = self.buffer[PROBE_BYTES:].data_ptr()
            f.lists.append(self.agent.prep_xfer_dlist("", np.array(
                [[here, PROBE_BYTES, self.device_id]], dtype=np.uint64), self.mem_type))
            f.lists.append(self.agent.prep_xfer_dlist(agent, np.array(
                [[address, PROBE_BYTES, device_id]], dtype=np.uint64), mem_type))
            f.handle = self.agent.make_prepped_xfer("READ", f.lists[0], [0], f.lists[1], [0])
            f.started = time.perf_counter()
            if self.agent.transfer(f.handle) == "ERR":
                f.error = "NIXL refused the read"
            while f.error is None and time.perf_counter() - f.started < SPIN_S:
                if self._state(f) != "PROC":
                    break
        except Exception as e:  # (a peer gone, memory it never registered: NIXL raises)
            f.error = str(e) or type(e).__name__

    def start_mapped(self, engine_id: str, where: str, memory: torch.Tensor, transport: str,
                     sent_sha256: str) -> None:
        """The probe of a peer whose probe buffer is mapped here (memory: its PROBE_BYTES,
        disagg.mapping.attach): a copy on the device, timed to its end (on a GPU, by CUDA
        events on a stream of its own, beside the steps)."""
        if self.busy:
            raise RuntimeError("a probe read is in flight")
        f = _Flight(engine_id, where, sent_sha256, None, [], time.perf_counter(), 0, None,
                    through=transport)
        self._flight = f
        try:
            if memory.is_cuda:
                f.events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
                with torch.cuda.stream(torch.cuda.Stream(memory.device)):
                    f.events[0].record()
                    self.buffer[PROBE_BYTES:].copy_(memory)
                    f.events[1].record()
            else:
                self.buffer[PROBE_BYTES:].copy_(memory)
                f.ended = time.perf_counter()
        except Exception as e:
            f.error, f.ended = str(e) or type(e).__name__, time.perf_counter()

    def fail(self, engine_id: str, where: str, error: str) -> None:
        """A probe that cannot start (result reports the error)."""
        if self.busy:
            raise RuntimeError("a probe read is in flight")
        self._flight = _Flight(engine_id, where, "", None, [], time.perf_counter(),
                               log_size(self.ucx_log), error)

    def _state(self, f: _Flight) -> str:
        """NIXL's state of the read ("PROC", "DONE", "ERR" or an error), noting its end."""
        if f.error:
            return "ERR"
        if f.through:
            if f.ended is None and not f.events[1].query():
                return "PROC"
            if f.ended is None:
                f.ended = f.started + f.events[0].elapsed_time(f.events[1]) / 1e3
            return "DONE"
        try:
            state = self.agent.check_xfer_state(f.handle)
        except Exception as e:  # (NIXL raises for a failed read)
            f.error, state = str(e) or type(e).__name__, "ERR"
        if state != "PROC" and f.ended is None:
            f.ended = time.perf_counter()
        return state

    def result(self, timeout_s: float, wait: bool = False) -> Route | None:
        """The read's finding once it ended (or failed, or passed timeout_s), else None; wait:
        spin until then (the peer's engine loop must poll meanwhile, as for any read)."""
        f = self._flight
        if f is None:
            return None
        state = self._state(f)
        while wait and state == "PROC" and time.perf_counter() - f.started < timeout_s:
            time.sleep(0)  # (the GIL for the server's threads)
            state = self._state(f)
        if state == "PROC" and time.perf_counter() - f.started < timeout_s:
            return None
        self._flight = None
        error = f.error or (None if state == "DONE" else f"no answer in {timeout_s:g} s"
                            if state == "PROC" else f"the read ended in {state}")
        if not self._release(f):
            self._stuck = f
        intact = error is None and sha256(self.buffer[PROBE_BYTES:]) == f.sha256
        if error is None and not intact:
            error = "its bytes arrived changed"
        found = {f.through} if f.through else transports(self.ucx_log, f.log_offset, self.name)
        seconds = (f.ended or time.perf_counter()) - f.started
        return Route(f.engine_id, f.where, frozenset(found), self.mem_type,
                     0.0 if error else PROBE_BYTES / max(seconds, 1e-9) / 1e9, intact, error,
                     f.through is not None)

    def _release(self, f: _Flight) -> bool:
        """Give NIXL back the read and its lists; False while it cannot cancel the read yet."""
        if f.handle is not None:
            try:
                self.agent.release_xfer_handle(f.handle)
            except Exception as e:
                logger.warning("NIXL keeps the probe read of %s for now: %s", f.where, e)
                return False
            f.handle = None
        for dlist in f.lists:
            try:
                self.agent.release_dlist_handle(dlist)
            except Exception as e:
                logger.warning("NIXL kept a probe descriptor list of %s: %s", f.where, e)
        f.lists.clear()
        if self._stuck is f:
            self._stuck = None
        return True
