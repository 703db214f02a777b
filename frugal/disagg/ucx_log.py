"""UCX's own account of its protocol choices, read back from its log.

With UCX_PROTO_INFO=y UCX prints, at a protocol's first use, a table per operation whose
"Config" column names the transports (`tcp/lo`, `cuda_ipc/cuda`, `cma/memory`,
`rc_mlx5/mlx5_0:1`, `cuda_copy/cuda` for a bounce through host memory, ...). `setup` sends
that log to a file of this process, `transports` reads an agent's remote-read tables back
(disagg.probe judges a route by them).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import tempfile

PROBE_BYTES = 8 << 20  # the message size whose tables count (disagg.probe's reads)

_TABLE_HEADER = re.compile(r"\|\s*(\S+) (?:intra|inter)-node cfg#\d+")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/[\w:.-]+")


def setup() -> str | None:
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


def flush() -> None:
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
    flush()
    return set().union(*(found for _, found in read_tables(path, agent, offset=offset)))
