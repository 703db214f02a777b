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
SLOW_VRAM_GB_PER_S = 10.0  # below this a VRAM route UCX did not name counts as slow

_TABLE_HEADER = re.compile(r"\|\s*(\S+) (?:intra|inter)-node cfg#\d+")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.-]+")
_SHARED_MEMORY = ("cma", "sysv", "posix", "xpmem", "knem", "self")


def setup_ucx_log() -> str | None:
    """Ask UCX (before its first context in this process) to log its protocol choices to a file
    of this process; the file's path, or None when the user's UCX_LOG_FILE or UCX_PROTO_INFO
    settings stand (the route is then judged by bandwidth alone)."""
    pattern = os.path.join(tempfile.gettempdir(), "frugal-ucx-%p.log")  # (UCX: %p, the pid)
    if os.environ.get("UCX_LOG_FILE") != pattern:  # (ours: this process's or its parent's)
        if "UCX_LOG_FILE" in os.environ or "UCX_PROTO_INFO" in os.environ:
            return None
        os.environ["UCX_PROTO_INFO"] = "y"
        os.environ["UCX_LOG_FILE"] = pattern
    return pattern.replace("%p", str(os.getpid()))


_ucs: list[ctypes.CDLL] = []  # UCX's base library, once found


def flush_ucx_log() -> None:
    """UCX writes its log through a buffered FILE: hand what it holds to the file now (through
    ucs_log_flush of the libucs this process loaded; NIXL's wheel bundles it)."""
    if not _ucs:
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps
                             if "/libucs" in line and ".so" in line), None)
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
        if lib is None or not hasattr(lib, "ucs_log_flush"):
            return
        _ucs.append(lib)
    _ucs[0].ucs_log_flush()


def log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def read_tables(path: str | None, agent: str) -> list[tuple[int, set[str]]]:
    """(offset in the log where it starts, transports in its `Config` column) of each
    remote-read table UCX logged for the agent (NIXL's name, UCX's worker name), in order."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    tables: list[tuple[int, set[str]]] = []
    owner, title, at = None, "", 0
    for line in text.splitlines(keepends=True):
        cells = line[line.find("|"):] if "|" in line else ""
        header = _TABLE_HEADER.search(cells)
        if header:
            owner, title = header.group(1), None
            if owner == agent:
                tables.append((at, set()))
        elif cells and owner is not None and title is None:
            title = cells
        elif cells.count("|") >= 4 and owner == agent and "remote memory read" in title:
            tables[-1][1].update(_TRANSPORT.findall(cells.rsplit("|", 2)[-2]))
        at += len(line.encode())
    return [(start, found) for start, found in tables if found]


def transports(path: str | None, offset: int, agent: str) -> set[str]:
    """The transports of the agent's remote reads that UCX logged past offset; if none (UCX
    logs a configuration once, at its first use), those of the last read it logged before."""
    flush_ucx_log()
    tables = read_tables(path, agent)
    later = [found for start, found in tables if start >= offset]
    return set().union(*later) if later else (tables[-1][1] if tables else set())


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
    lists: tuple
    started: float
    log_offset: int  # of the UCX log when it started
    error: str | None


def sha256(data: torch.Tensor) -> str:
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()


class Prober:
    """One NIXL agent's probe buffer, 2 * PROBE_BYTES on its pool's device, registered with the
    agent: [0, PROBE_BYTES) random bytes peers read (address, sha256 in its metadata), the
    rest the place this agent's own probe reads land. One probe read at a time; a read given up
    may still land later, where only probes look."""

    def __init__(self, agent, name: str, device: torch.device, mem_type: str, device_id: int,
                 ucx_log: str | None) -> None:
        self.agent, self.name, self.ucx_log = agent, name, ucx_log
        self.mem_type, self.device_id = mem_type, device_id
        self.buffer = torch.randint(0, 256, (2 * PROBE_BYTES,), dtype=torch.uint8,
                                    device=device)
        self.sha256 = sha256(self.buffer[:PROBE_BYTES])
        self._registered = agent.register_memory(self.buffer)
        self._flight: _Flight | None = None

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    @property
    def busy(self) -> bool:
        return self._flight is not None

    def start(self, engine_id: str, where: str, agent: str, address: int, device_id: int,
              mem_type: str, sent_sha256: str) -> None:
        """Start reading PROBE_BYTES at address of the peer (NIXL's name `agent`)."""
        if self._flight is not None:
            raise RuntimeError("a probe read is in flight")
        flush_ucx_log()
        offset = log_size(self.ucx_log)
        here = self.buffer[PROBE_BYTES:].data_ptr()
        lists = (self.agent.prep_xfer_dlist("", np.array(
                     [[here, PROBE_BYTES, self.device_id]], dtype=np.uint64), self.mem_type),
                 self.agent.prep_xfer_dlist(agent, np.array(
                     [[address, PROBE_BYTES, device_id]], dtype=np.uint64), mem_type))
        handle, error = None, None
        try:
            handle = self.agent.make_prepped_xfer("READ", lists[0], [0], lists[1], [0])
            if self.agent.transfer(handle) == "ERR":
                error = "NIXL refused the read"
        except Exception as e:  # (a peer gone: NIXL raises)
            error = str(e) or type(e).__name__
        self._flight = _Flight(engine_id, where, sent_sha256, handle, lists,
                               time.perf_counter(), offset, error)

    def result(self, timeout_s: float, wait: bool = False) -> Route | None:
        """The read's finding once it ended (or failed, or passed timeout_s), else None; wait:
        spin until then (the peer's engine loop must poll meanwhile, as for any read)."""
        f = self._flight
        if f is None:
            return None
        state = "ERR" if f.error else self.agent.check_xfer_state(f.handle)
        while wait and state == "PROC" and time.perf_counter() - f.started < timeout_s:
            time.sleep(0)  # (the GIL for the server's threads)
            state = self.agent.check_xfer_state(f.handle)
        seconds = time.perf_counter() - f.started
        if state == "PROC" and seconds < timeout_s:
            return None
        error = f.error or (None if state == "DONE" else f"no answer in {timeout_s:g} s"
                            if state == "PROC" else f"the read ended in {state}")
        self._flight = None
        try:
            if f.handle is not None:
                self.agent.release_xfer_handle(f.handle)
            for dlist in f.lists:
                self.agent.release_dlist_handle(dlist)
        except Exception as e:
            logger.warning("NIXL kept the probe read of %s: %s", f.where, e)
        intact = error is None and sha256(self.buffer[PROBE_BYTES:]) == f.sha256
        found = transports(self.ucx_log, f.log_offset, self.name)
        return Route(f.engine_id, f.where, frozenset(found), self.mem_type,
                     0.0 if error else PROBE_BYTES / seconds / 1e9, intact, error)

