"""KV pages between workers over NIXL: one agent per engine, its whole pool registered once;
between workers on one host, through the peer's pool mapped here (disagg.direct) where it can be.

A page is num_layers * parts chunks (KVPool.storage, chunk-major: chunk c of page p at
c * num_pages + p), so consecutive pages of one chunk are contiguous. Each read describes both
sides for the pages it takes alone (what a peer's pool claims to hold costs nothing here), one
descriptor per chunk and run of pages consecutive on both sides (page_runs): a 4,096-token
prompt in 256 fresh pages of Llama-3.1-8B moves as 64 descriptors, not 16,384. The decode
side READs from the prefill side (pull, as vLLM's NixlConnector does), and the READ's
notification tells the prefill side which request's pages it may free. Memory is DRAM for a CPU
pool, VRAM for a CUDA one (UCX moves both). Beside the pool each agent registers a probe buffer:
random bytes a peer reads once (disagg.probe), then the place such a read lands.

With map_peers (--kv-transport auto) the metadata also describes the pool and the probe buffer
for a peer on this host to map (disagg.direct.offer), and a peer whose pool maps here is read
by a page copy of this worker's (direct.Copies) instead of NIXL; a copy that ended well sends
the notification a NIXL READ's end would. Other peers go over NIXL. A mapped peer whose
process ended is unmapped (checked at each connect and every LIVENESS_S while reads are
polled): its later reads go over NIXL and fail as a dead peer's do.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from dataclasses import dataclass

from frugal.disagg import direct, mapping, probe, ucx_log
from frugal.disagg.layout import KVLayout, descriptors, meta_int, page_runs
from frugal.worker.kv_pool import KVPool

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


MAX_REMOTE_PAGES = 1 << 24  # no pool has more: a claim of more is refused unread
MEM_TYPES = ("DRAM", "VRAM")
LIVENESS_S = 5.0  # how often polls look for mapped peers that ended


@dataclass
class _Remote:
    name: str  # NIXL's name of the peer's agent
    base_addr: int
    num_pages: int
    device_id: int
    mem_type: str
    probe_addr: int | None
    probe_sha256: str | None
    where: str
    mapping: direct.Mapping | None = None  # its pool mapped here (disagg.direct)


@dataclass
class _Read:
    handle: object
    lists: tuple  # the prepared descriptor lists of both sides
    started: float


class NixlTransfer:
    """One NIXL agent (named engine_id) over one pool. Not thread-safe: the engine thread
    alone calls it."""

    def __init__(self, pool: KVPool, engine_id: str, map_peers: bool = True) -> None:
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
        self.ucx_log = ucx_log.setup()
        if self.ucx_log:
            logger.info("UCX logs to %s", self.ucx_log)
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        self._registered = self.agent.register_memory(storage)
        self.prober = probe.Prober(self.agent, engine_id, storage.device, self.mem_type,
                                   self.device_id, self.ucx_log, shareable=map_peers)
        self.copies = direct.Copies(pool) if map_peers else None
        self._chunks = self.layout.num_layers * self.layout.parts
        self._remotes: dict[str, _Remote] = {}
        self._next_liveness = 0.0  # when to look again for mapped peers that ended
        self._reads: dict[str, _Read] = {}

    def metadata(self) -> dict:
        """What a peer needs to read this pool (served on the prefill worker's side channel)."""
        return {"engine_id": self.engine_id, "layout": self.layout.__dict__,
                "agent_metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "base_addr": self.pool.storage.data_ptr(), "num_pages": self.pool.num_pages,
                "mem_type": self.mem_type, "device_id": self.device_id,
                "chunk_bytes": self.pool.chunk_bytes, "probe_addr": self.prober.address,
                "probe_sha256": self.prober.sha256,
                "mapped": None if self.copies is None else direct.offer(
                    self.pool, self.prober.buffer[:probe.PROBE_BYTES], self.prober.memfd)}

    def connect(self, meta: dict, where: str) -> None:
        """Know the peer described by `meta` (its metadata()); ValueError if its pool's layout
        differs from this one's or a field is not what metadata() makes. Idempotent per
        engine_id. Every field is checked before anything is built, and nothing is built per
        page of the peer's pool (a read prepares the descriptors of its own pages)."""
        engine_id = meta.get("engine_id")
        if not isinstance(engine_id, str):
            raise ValueError(f"the prefill worker at {where} sent no engine_id")
        if engine_id in self._remotes:
            self._forget_ended()
            return
        layout = meta.get("layout")
        try:
            remote = KVLayout(**layout)
        except TypeError:
            raise ValueError(f"the prefill worker at {where} sent no KV layout") from None
        self.layout.check(remote, where)
        if meta.get("chunk_bytes") != self.pool.chunk_bytes:
            raise ValueError(f"kv_transfer_params: the prefill worker at {where} has pages of "
                             f"{meta.get('chunk_bytes')!r} bytes a chunk, this one "
                             f"{self.pool.chunk_bytes}")
        num_pages = meta_int(meta, "num_pages", 1, MAX_REMOTE_PAGES + 1)
        base_addr = meta_int(meta, "base_addr")
        device_id = meta_int(meta, "device_id", 0, 1 << 16)
        # (a prefill worker of an earlier frugal offers no probe: its route stays unknown)
        probe_addr = None if "probe_addr" not in meta else meta_int(meta, "probe_addr")
        mem_type = meta.get("mem_type")
        agent = meta.get("agent_metadata")
        if mem_type not in MEM_TYPES or not isinstance(agent, str):
            raise ValueError(f"the prefill worker at {where} sent no memory type or agent")
        probe_sha256 = meta.get("probe_sha256")
        if probe_addr is not None and not isinstance(probe_sha256, str):
            raise ValueError(f"the prefill worker at {where} sent a probe without its sha256")
        name = self.agent.add_remote_agent(base64.b64decode(agent, validate=True))
        remote = _Remote(name, base_addr, num_pages, device_id, mem_type, probe_addr,
                         probe_sha256, where)
        if self.copies is not None and isinstance(meta.get("mapped"), dict):
            remote.mapping = direct.map_peer(meta["mapped"], num_pages * self._chunks *
                                            self.pool.chunk_bytes, self.pool.storage.device,
                                            where)
        self._remotes[engine_id] = remote

    def _forget_ended(self) -> None:
        """Unmap the pools of peers whose process ended (a mapping would keep a dead worker's
        pool in memory); their hand-offs go over NIXL then, and fail as a dead peer's do."""
        self._next_liveness = time.monotonic() + LIVENESS_S
        for remote in self._remotes.values():
            if remote.mapping is not None and not mapping.alive(remote.mapping.desc):
                logger.warning("the prefill worker at %s has ended: its pool is unmapped",
                               remote.where)
                remote.mapping = None

    def start_probe(self, engine_id: str, where: str) -> None:
        """Start the probe read of a known peer (disagg.probe; self.prober.result ends it)."""
        r = self._remotes[engine_id]
        m = r.mapping
        if m is not None and m.probe is not None and r.probe_sha256 is not None:
            self.prober.start_mapped(engine_id, where, m.probe, m.transport, r.probe_sha256)
        elif r.probe_addr is None:
            self.prober.fail(engine_id, where, "it offers no probe buffer (an earlier frugal)")
        else:
            self.prober.start(engine_id, where, r.name, r.probe_addr, r.device_id, r.mem_type,
                              r.probe_sha256)

    def maps(self, engine_id: str) -> bool:
        """Whether reads from that peer copy from its pool mapped here (now)."""
        return self._remotes[engine_id].mapping is not None

    def num_remote_pages(self, engine_id: str) -> int:
        return self._remotes[engine_id].num_pages

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
        if remote.mapping is not None:
            self.copies.start(key, local_pages, remote.mapping.pool, remote_pages,
                              lambda: self.notify(engine_id, notif))
            return
        runs = page_runs(local_pages, remote_pages)
        here, there, lengths = (list(x) for x in zip(*runs)) if runs else ([], [], [])
        size = self.pool.chunk_bytes
        lists = (self.agent.prep_xfer_dlist("", descriptors(
                     self.pool.storage.data_ptr(), self.pool.num_pages, here, lengths,
                     self.device_id, self._chunks, size), self.mem_type),
                 self.agent.prep_xfer_dlist(remote.name, descriptors(
                     remote.base_addr, remote.num_pages, there, lengths, remote.device_id,
                     self._chunks, size), remote.mem_type))
        index = list(range(self._chunks * len(runs)))
        handle = None
        try:
            handle = self.agent.make_prepped_xfer("READ", lists[0], index, lists[1], index,
                                                  notif)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"NIXL refused the read from {engine_id}")
        except Exception:  # (a peer gone: NIXL raises a disconnect error)
            if handle is not None:
                self._forget(handle)
            for dlist in lists:
                self.agent.release_dlist_handle(dlist)
            raise
        self._reads[key] = _Read(handle, lists, time.monotonic())

    def done(self, min_age: float = 0.0) -> list[tuple[str, str | None]]:
        """Reads that ended since the last call: (key, None) or (key, what went wrong); a read
        younger than min_age seconds is not looked at yet."""
        ended, now = [] if self.copies is None else self.copies.done(min_age), time.monotonic()
        if now >= self._next_liveness:
            self._forget_ended()
        for key, read in list(self._reads.items()):
            if now - read.started < min_age:
                continue
            try:
                state = self.agent.check_xfer_state(read.handle)
            except Exception as e:  # a peer that died mid-read
                state = f"an error ({e})"
            if state == "PROC":
                continue
            try:
                self._release(key)
            except Exception as e:  # it ended: what NIXL keeps of it is no longer ours to free
                logger.warning("NIXL could not release the ended KV read %s: %s", key, e)
                self._reads.pop(key, None)
            ended.append((key, None if state == "DONE" else f"the NIXL read ended in {state}"))
        return ended

    def cancel(self, key: str) -> bool:
        """Give up the read under key: True once it can no longer write the local pages (NIXL
        cancelled it, or it had ended), False while NIXL cannot cancel it yet (ask again)."""
        if self.copies is not None and key in self.copies:
            return self.copies.cancel(key)
        if key not in self._reads:
            return True
        try:
            self._release(key)
        except Exception as e:
            logger.warning("NIXL could not cancel the KV read %s yet: %s", key, e)
            return False
        return True

    def _release(self, key: str) -> None:
        read = self._reads[key]
        self.agent.release_xfer_handle(read.handle)  # raises while it cannot be cancelled
        del self._reads[key]
        for dlist in read.lists:
            self.agent.release_dlist_handle(dlist)

    def _forget(self, handle) -> None:
        """Release a transfer that never started (or failed at once)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:
            logger.warning("NIXL kept a failed transfer's handle: %s", e)

    def in_flight(self, key: str) -> float | None:
        """Seconds since the read under key started, None if it is not in flight."""
        if self.copies is not None and key in self.copies:
            return self.copies.in_flight(key)
        read = self._reads.get(key)
        return None if read is None else time.monotonic() - read.started

    def notify(self, engine_id: str, message: bytes) -> None:
        """Tell a known peer something (a prefill worker: free these pages); never raises (a
        peer that died: its later hand-offs fail in their reads, each alone)."""
        remote = self._remotes.get(engine_id)
        if remote is None:
            return
        try:
            self.agent.send_notif(remote.name, message)
        except Exception as e:
            logger.warning("the prefill worker %s does not answer: %s", engine_id, e)

    def notifications(self) -> list[bytes]:
        """Messages peers sent (a read's completion included) since the last call."""
        try:
            return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
        except Exception as e:  # (a peer's disconnect): the leases run out instead
            logger.warning("NIXL notifications failed: %s", e)
            return []
