"""Which way a KV hand-off between two workers goes, found before the first one.

A decode worker READs a small buffer (PROBE_BYTES) that a prefill worker registered beside its
pool, the first time it meets that worker, and reports the route UCX chose for the read and
the bandwidth it got. UCX tells its choice only in its log: with UCX_PROTO_INFO=y it prints,
at a protocol's first use, a table per operation whose "Config" column names the transports
(`tcp/lo`, `cuda_ipc/cuda`, `cma/memory`, `rc_mlx5/mlx5_0:1`, `cuda_copy/cuda` for a bounce
through host memory, ...). setup_ucx_log sends that log to a file of this process, which
`transports` reads back.

A route through TCP or through host memory (VRAM pools) is slow: a loud warning, a metric,
and with --kv-require-fast-path a refusal of the peer's hand-offs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("frugal")

PROBE_BYTES = 8 << 20
SPIN_S = 0.05  # how long starting a probe waits for its end (8 MiB at 0.17 GB/s or more)
SLOW_VRAM_GB_PER_S = 10.0  # below this a VRAM route UCX did not name counts as slow

_TABLE_HEADER = re.compile(r"\|\s*(\S+) (?:intra|inter)-node cfg#\d+")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.-]+")
_SHARED_MEMORY = ("cma", "sysv", "posix", "xpmem", "knem", "self")


def setup_ucx_log() -> str | None:
    """Ask UCX (before its first context in this process) to log its protocol choices to a file
    of this process, in a directory only this user reaches (made once, inherited by child
    processes through the environment; the file is removed at exit); the file's path, or None
    when the user's UCX_LOG_FILE or UCX_PROTO_INFO settings stand (the route is then judged by
    its bandwidth alone, and only a GPU pool's)."""
    pattern = os.environ.get("FRUGAL_UCX_LOG")
    if pattern is None or os.environ.get("UCX_LOG_FILE") != pattern:
        if "UCX_LOG_FILE" in os.environ or "UCX_PROTO_INFO" in os.environ:
            return None
        # (UCX puts the pid for %p; mkdtemp's directory is the user's alone, mode 0700)
        pattern = os.path.join(tempfile.mkdtemp(prefix="frugal-ucx-"), "ucx-%p.log")
        os.environ.update(FRUGAL_UCX_LOG=pattern, UCX_LOG_FILE=pattern, UCX_PROTO_INFO="y")
    path = pattern.replace("%p", str(os.getpid()))
    if path not in _ours:
        _ours.append(path)
        atexit.register(_remove, path)
    return path


_ours: list[str] = []  # this process's UCX log files


def _remove(path: str) -> None:
    """This process's log, and its directory once no other process's log is left there."""
    with contextlib.suppress(OSError):
        os.remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


_ucs: list[ctypes.CDLL] = []  # UCX's base library, once found


def flush_ucx_log() -> None:
    """UCX writes its log through a buffered FILE: hand what it holds to the file now (through
    ucs_log_flush of the libucs this process loaded, NIXL's bundled one first)."""
    if not _ucs:
        try:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "/libucs" in line and ".so" in line]
            paths.sort(key=lambda path: "nixl" not in path)
            lib = ctypes.CDLL(paths[0]) if paths else None
        except OSError:
            lib = None
        if lib is None or not hasattr(lib, "ucs_log_flush"):
            return
        lib.ucs_log_flush.restype = None
        _ucs.append(lib)
    _ucs[0].ucs_log_flush()


def log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _covers(cell: str, size: int) -> bool:
    """Whether a table's Range cell ("0", "85..8240", "8241..inf") holds messages of size."""
    low, _, high = cell.strip().partition("..")
    try:
        return int(low) <= size and (high == "inf" or size <= int(high or low))
    except ValueError:
        return False


def read_tables(path: str | None, agent: str, size: int = PROBE_BYTES, offset: int = 0
                ) -> list[tuple[int, set[str]]]:
    """(byte offset in the log where it starts, transports in its `Config` column for messages
    of `size` bytes) of each remote-read table UCX logged for the agent (NIXL's name, UCX's
    worker name) from offset on, in order."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return []
    tables: list[tuple[int, set[str]]] = []
    owner, title, at = None, "", offset
    for raw in data.splitlines(keepends=True):
        line = raw.decode(errors="replace")
        cells = line[line.find("|"):] if "|" in line else ""
        header = _TABLE_HEADER.search(cells)
        if header:
            owner, title = header.group(1), None
            if owner == agent:
                tables.append((at, set()))
        elif cells and owner is not None and title is None:
            title = cells
        elif (cells.count("|") >= 4 and owner == agent and "remote memory read" in title
              and _covers(cells.split("|")[1], size)):
            tables[-1][1].update(_TRANSPORT.findall(cells.rsplit("|", 2)[-2]))
        at += len(raw)
    return [(start, found) for start, found in tables if found]


def transports(path: str | None, offset: int, agent: str) -> set[str]:
    """The transports of the agent's remote reads of PROBE_BYTES that UCX logged past offset
    (empty when it logged none: a configuration is logged once, at its first use)."""
    flush_ucx_log()
    return set().union(*(found for _, found in read_tables(path, agent, offset=offset)))


@dataclass(frozen=True)
class Route:
    """A probe's finding: the peer's engine_id and where it is, transports UCX named (empty:
    it named none), the local pool's memory ("DRAM" / "VRAM"), GB/s of the probe read (0 if
    it did not end), whether its bytes arrived as sent, what went wrong (None: it ended)."""

    engine_id: str
    where: str
    transports: frozenset[str]
    mem_type: str
    gb_per_s: float
    intact: bool
    error: str | None = None

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
        return (f"KV hand-offs from {self.where} go over {self.kind}{named}: "
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


def sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()


class Prober:
    """One NIXL agent's probe buffer, 2 * PROBE_BYTES on its pool's device, registered with the
    agent: [0, PROBE_BYTES) random bytes peers read (address, sha256 in its metadata), the
    rest the place this agent's own probe reads land. One probe read at a time, and none while
    a read given up is not yet released (it could still land there). Never raises: what goes
    wrong is the Route's error."""

    def __init__(self, agent, name: str, device: torch.device, mem_type: str, device_id: int,
                 ucx_log: str | None) -> None:
        self.agent, self.name, self.ucx_log = agent, name, ucx_log
        self.mem_type, self.device_id = mem_type, device_id
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
        flush_ucx_log()
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
        found = transports(self.ucx_log, f.log_offset, self.name)
        seconds = (f.ended or time.perf_counter()) - f.started
        return Route(f.engine_id, f.where, frozenset(found), self.mem_type,
                     0.0 if error else PROBE_BYTES / max(seconds, 1e-9) / 1e9, intact, error)

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
