"""KV pages between workers over NIXL: one agent per engine, its whole pool registered once.

A page is num_layers * parts contiguous chunks (KVPool.storage); the pool is described to NIXL
as one list of chunks, chunk (c, page) at index c * num_pages + page, so moving pages is one
prepared transfer of their chunks. The decode side READs from the prefill side (pull, as vLLM's
NixlConnector does), and the READ's notification tells the prefill side which request's pages
it may free. Memory is DRAM for a CPU pool, VRAM for a CUDA one (UCX moves both).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import time
from dataclasses import dataclass

from frugal.kv_cache.pool import KVPool

logger = logging.getLogger("frugal")


def import_nixl():
    """NIXL's Python API (from the nixl-cu13 or nixl-cu12 wheel, or the nixl meta package)."""
    for name in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise RuntimeError("kv_role: prefill/decode disaggregation needs NIXL: "
                       "pip install 'frugal[pd]' (nixl-cu13)")


@dataclass(frozen=True)
class KVLayout:
    """What two workers' pools must share for pages to move between them unchanged. Weights
    may differ (an FP8 prefill worker beside an INT4 decode worker)."""

    num_layers: int
    parts: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str
    kv_scales_sha256: str  # of the FP8 scales' bytes; "" without scales

    @classmethod
    def of(cls, pool: KVPool) -> KVLayout:
        num_layers, parts, _, page_size, heads, head_dim = pool.storage.shape
        scales = ("" if pool.scales is None else
                  hashlib.sha256(pool.scales.float().cpu().numpy().tobytes()).hexdigest())
        return cls(num_layers, parts, page_size, heads, head_dim,
                   str(pool.dtype).removeprefix("torch."), scales)

    def check(self, remote: KVLayout, where: str) -> None:
        """Raise ValueError naming every field where `remote` (the worker at `where`)
        differs from this worker."""
        wrong = [f"{name} {getattr(remote, name)!r} there, {getattr(self, name)!r} here"
                 for name in self.__dataclass_fields__
                 if getattr(remote, name) != getattr(self, name)]
        if wrong:
            raise ValueError(f"kv_transfer_params: the prefill worker at {where} keeps a KV "
                             f"cache this worker cannot read: {'; '.join(wrong)}")


@dataclass
class _Remote:
    name: str
    pages: object  # prepared descriptor list of its pool
    num_pages: int


@dataclass
class _Read:
    handle: object
    started: float


class NixlTransfer:
    """One NIXL agent (named engine_id) over one pool. Not thread-safe: the engine thread
    alone calls it."""

    def __init__(self, pool: KVPool, engine_id: str) -> None:
        nixl = import_nixl()
        self.pool, self.engine_id = pool, engine_id
        self.layout = KVLayout.of(pool)
        storage = pool.storage
        self.mem_type = "VRAM" if storage.is_cuda else "DRAM"
        self.device_id = (storage.device.index or 0) if storage.is_cuda else 0
        # No progress thread (NIXL's spins without pause and would take a core from the
        # steps): the engine's polls (done, notifications) make progress, on both sides, as a
        # read over UCX's TCP or shared-memory transports needs the side read from to progress.
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=[])
        self.agent = nixl.nixl_agent(engine_id, config)
        # UCX's peer error handling (NIXL's default: a dead peer fails its transfers) rules out
        # its shared-memory and CUDA IPC transports, leaving TCP; "none" allows them (a dead
        # peer's reads then end by --kv-transfer-timeout).
        mode = os.environ.get("FRUGAL_UCX_ERROR_HANDLING", "peer")
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        self._registered = self.agent.register_memory(storage)
        self._chunks = self.layout.num_layers * self.layout.parts
        self._local = self.agent.prep_xfer_dlist(
            "", self._descs(storage.data_ptr(), pool.num_pages, pool.chunk_bytes,
                            self.device_id), self.mem_type)
        self._remotes: dict[str, _Remote] = {}
        self._reads: dict[str, _Read] = {}

    def _descs(self, base: int, num_pages: int, size: int,
               device_id: int) -> list[tuple[int, int, int]]:
        """A pool's chunks as NIXL descriptors, chunk (c, page) at index c * num_pages + page."""
        return [(base + i * size, size, device_id) for i in range(self._chunks * num_pages)]

    def _indices(self, pages: list[int], num_pages: int) -> list[int]:
        return [c * num_pages + p for c in range(self._chunks) for p in pages]

    def metadata(self) -> dict:
        """What a peer needs to read this pool (served on the prefill worker's side channel)."""
        return {"engine_id": self.engine_id, "layout": self.layout.__dict__,
                "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "base_addr": self.pool.storage.data_ptr(), "num_pages": self.pool.num_pages,
                "mem_type": self.mem_type, "device_id": self.device_id,
                "chunk_bytes": self.pool.chunk_bytes}

    def connect(self, meta: dict, where: str) -> None:
        """Know the peer described by `meta` (its metadata()); ValueError if its pool's layout
        differs from this one's. Idempotent per engine_id."""
        engine_id = meta["engine_id"]
        if engine_id in self._remotes:
            return
        self.layout.check(KVLayout(**meta["layout"]), where)
        if meta["chunk_bytes"] != self.pool.chunk_bytes:
            raise ValueError(f"kv_transfer_params: the prefill worker at {where} has pages of "
                             f"{meta['chunk_bytes']} bytes a chunk, this one "
                             f"{self.pool.chunk_bytes}")
        name = self.agent.add_remote_agent(base64.b64decode(meta["agent_metadata"]))
        descs = self._descs(meta["base_addr"], meta["num_pages"], meta["chunk_bytes"],
                            meta["device_id"])
        pages = self.agent.prep_xfer_dlist(name, descs, meta["mem_type"])
        self._remotes[engine_id] = _Remote(name, pages, meta["num_pages"])

    def read(self, key: str, local_pages: list[int], engine_id: str, remote_pages: list[int],
             notif: bytes) -> None:
        """Start copying remote_pages of the peer into local_pages (same order); the peer
        receives `notif` when the copy is done. Raises ValueError for a page id the peer does
        not have, RuntimeError when NIXL refuses."""
        remote = self._remotes[engine_id]
        bad = [p for p in remote_pages if not 0 <= p < remote.num_pages]
        if bad:
            raise ValueError(f"kv_transfer_params: remote_block_ids: page {bad[0]} is not in "
                             f"[0, {remote.num_pages})")
        handle = self.agent.make_prepped_xfer(
            "READ", self._local, self._indices(local_pages, self.pool.num_pages), remote.pages,
            self._indices(remote_pages, remote.num_pages), notif)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"NIXL refused the read from {engine_id}")
        self._reads[key] = _Read(handle, time.monotonic())

    def done(self, min_age: float = 0.0) -> list[tuple[str, str | None]]:
        """Reads that ended since the last call: (key, None) or (key, what went wrong); a read
        younger than min_age seconds is not looked at yet."""
        ended, now = [], time.monotonic()
        for key, read in list(self._reads.items()):
            if now - read.started < min_age:
                continue
            state = self.agent.check_xfer_state(read.handle)
            if state == "PROC":
                continue
            self.agent.release_xfer_handle(read.handle)
            del self._reads[key]
            ended.append((key, None if state == "DONE" else f"the NIXL read ended in {state}"))
        return ended

    def in_flight(self, key: str) -> float | None:
        """Seconds since the read under key started, None if it is not in flight."""
        read = self._reads.get(key)
        return None if read is None else time.monotonic() - read.started

    def notify(self, engine_id: str, message: bytes) -> None:
        """Tell a known peer something (a prefill worker: free these pages)."""
        remote = self._remotes.get(engine_id)
        if remote is not None:
            self.agent.send_notif(remote.name, message)

    def notifications(self) -> list[bytes]:
        """Messages peers sent (a read's completion included) since the last call."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
