"""KV hand-offs between two workers on one host without NIXL: the decode worker maps the prefill
worker's pool into its own address space (disagg.mapping: CUDA IPC for a GPU pool, the pool's
memory file for a CPU one) and copies a prompt's pages itself, in one launch (ops copy_pages)
beside its steps.

What lets a peer map a pool (`offer`) travels only in the metadata the prefill worker signs and
serves to holders of the deployment's secret (server.side_channel), as NIXL's registration does.
A peer whose pool does not map here (another host, a container without the prefill worker's PID
namespace, another GPU) keeps NIXL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from frugal import ops
from frugal.disagg.mapping import Unmappable, attach, describe
from frugal.disagg.ucx_log import PROBE_BYTES
from frugal.worker.kv_pool import KVPool

logger = logging.getLogger("frugal")


def offer(pool: KVPool, probe: torch.Tensor, probe_memfd: int | None) -> dict:
    """The descriptions of a pool and of its worker's probe buffer (disagg.probe) that a peer on
    this host maps them by (map_peer)."""
    return {"pool": describe(pool.storage, pool.memfd), "probe": describe(probe, probe_memfd)}


@dataclass
class Mapping:
    """A peer's pool (uint8 [its bytes]) and probe buffer (uint8 [PROBE_BYTES], or None) mapped
    here, with the pool's description (mapping.alive tells whether its process still runs)."""

    pool: torch.Tensor
    probe: torch.Tensor | None
    desc: dict

    @property
    def transport(self) -> str:
        """The transport's name, as a probe reports it: "cuda_ipc" or "memfd"."""
        return "cuda_ipc" if self.pool.is_cuda else "memfd"


def map_peer(offered: dict, pool_bytes: int, device: torch.device, where: str
             ) -> Mapping | None:
    """A peer's offer() mapped here, or None (its hand-offs then go over NIXL), logged with
    why not."""
    try:
        pool = attach(offered.get("pool"), pool_bytes, device)
        probe = (None if offered.get("probe") is None else
                 attach(offered["probe"], PROBE_BYTES, device))
    except Unmappable as e:
        logger.info("KV hand-offs from %s go through NIXL: its pool does not map here (%s)",
                    where, e)
        return None
    return Mapping(pool, probe, offered["pool"])


@dataclass
class _Copy:
    """A copy in flight: when it started, whether it has ended, what went wrong (None: it
    ended well), what to run once it has ended well, and the tensors its launch reads and
    writes through until then (a GPU copy's page lists, here and on the host, and source)."""

    started: float
    ended: Callable[[], bool]
    error: Callable[[], str | None]
    then: Callable[[], None]
    keep: tuple


class Copies:
    """Page copies in flight from mapped peers' pools into one pool (engine thread only). On a
    GPU each is one launch on a stream of its own, queued after the steps launched so far
    (pages just given to a request may still be written by one) without the host waiting for
    them, its end an event (the kernel is compiled here: a module loaded mid-serving would
    wait for the whole GPU); on a CPU
    the engine thread copies at once (memcpy speed: a thread of its own would wait for the
    GIL between pages while the engine loop runs)."""

    def __init__(self, pool: KVPool) -> None:
        storage = pool.storage
        self.chunks, self.chunk_bytes = storage.shape[0] * storage.shape[1], pool.chunk_bytes
        self._local = storage.view(torch.uint8).view(self.chunks, pool.num_pages, -1)
        self._cuda = storage.is_cuda
        self._copy = ops.load("triton" if self._cuda else "torch_ref").copy_pages
        self._stream = torch.cuda.Stream(storage.device) if self._cuda else None
        self._copies: dict[str, _Copy] = {}
        if self._cuda:  # (the copy kernel compiled now: loading it later waits for the GPU)
            with torch.cuda.stream(self._stream):
                _, d, s = self._lists([0], [0])
                self._copy(self._local, d, self._local, s)

    def _lists(self, local_pages: list[int], remote_pages: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the pinned host array, the local and remote page lists on the device), copied on
        the current stream. One array (lists convert slowly), pinned (a pageable copy would
        wait on the host for the stream, and the copy stream waits for the steps in flight),
        its rows padded to an even length (both lists 16-byte aligned at any length: one
        compiled variant of the copy kernel, the one compiled at start-up)."""
        n = len(local_pages)
        host = np.zeros((2, n + n % 2), dtype=np.int64)
        host[0, :n], host[1, :n] = local_pages, remote_pages
        host = torch.from_numpy(host).pin_memory()
        d, s = host.to(self._local.device, non_blocking=True)[:, :n]
        return host, d, s

    def __contains__(self, key: str) -> bool:
        return key in self._copies

    def start(self, key: str, local_pages: list[int], remote: torch.Tensor, remote_pages:
              list[int], then: Callable[[], None]) -> None:
        """Start copying remote_pages of `remote` (a mapped pool: mapping.attach) into
        local_pages (same order, as many; ValueError otherwise); then() runs once done() finds
        the copy ended well (as a NIXL READ's notification goes out only for a read that
        ended well: the caller answers for the others)."""
        if len(local_pages) != len(remote_pages):
            raise ValueError(f"copy: {len(local_pages)} pages here, {len(remote_pages)} there")
        src = remote.view(self.chunks, -1, self.chunk_bytes)
        device = self._local.device
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                host, d, s = self._lists(local_pages, remote_pages)
                self._copy(self._local, d, src, s)
                event = torch.cuda.Event()
                event.record(self._stream)
            copy = _Copy(time.monotonic(), event.query, lambda: None, then, (d, s, src, host))
        else:
            try:
                self._copy(self._local, torch.tensor(local_pages, dtype=torch.int64), src,
                           torch.tensor(remote_pages, dtype=torch.int64))
                error = None
            except Exception as e:
                error = f"the page copy failed ({e})"
            copy = _Copy(time.monotonic(), lambda: True, lambda: error, then, ())
        self._copies[key] = copy

    def done(self, min_age: float = 0.0) -> list[tuple[str, str | None]]:
        """Copies that ended since the last call: (key, None) or (key, what went wrong); one
        younger than min_age seconds is not looked at yet."""
        ended, now = [], time.monotonic()
        for key, copy in list(self._copies.items()):
            if now - copy.started >= min_age and copy.ended():
                del self._copies[key]
                error = copy.error()
                if error is None:
                    copy.then()
                ended.append((key, error))
        return ended

    def cancel(self, key: str) -> bool:
        """True once the copy under key can no longer write (it ended: then it is forgotten,
        then() not run); a copy cannot be stopped, and ends soon."""
        if key not in self._copies:
            return True
        if not self._copies[key].ended():
            return False
        del self._copies[key]
        return True

    def in_flight(self, key: str) -> float | None:
        """Seconds since the copy under key started, None if it is not in flight."""
        copy = self._copies.get(key)
        return None if copy is None else time.monotonic() - copy.started
