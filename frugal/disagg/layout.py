"""What two workers' KV pools must share for pages to move between them unchanged, and the
runs of pages a transfer between them describes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from frugal.worker.kv_pool import KVPool


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
                   pool.name, scales)

    def check(self, remote: KVLayout, where: str) -> None:
        """Raise ValueError naming every field where `remote` (the worker at `where`)
        differs from this worker."""
        wrong = [f"{name} {getattr(remote, name)!r} there, {getattr(self, name)!r} here"
                 for name in self.__dataclass_fields__
                 if getattr(remote, name) != getattr(self, name)]
        if wrong:
            raise ValueError(f"kv_transfer_params: the prefill worker at {where} keeps a KV "
                             f"cache this worker cannot read: {'; '.join(wrong)}")


def page_runs(local_pages: list[int], remote_pages: list[int]) -> list[tuple[int, int, int]]:
    """(local first page, remote first page, pages) of each stretch where both sides' pages
    go up by one, in order: the pairs (local_pages[i], remote_pages[i]) are those of the runs."""
    runs: list[tuple[int, int, int]] = []
    for here, there in zip(local_pages, remote_pages, strict=True):
        if runs and here == runs[-1][0] + runs[-1][2] and there == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((here, there, 1))
    return runs


def descriptors(base: int, num_pages: int, firsts, lengths, device_id: int, chunks: int,
                chunk_bytes: int) -> np.ndarray:
    """NIXL descriptors [n, 3] (address, bytes, device) of runs of pages (first page, pages)
    in a pool of num_pages at base, chunk-major (KVPool.storage): row c * len(firsts) + i is
    chunk c of run i, lengths[i] pages long."""
    size = np.uint64(chunk_bytes)
    firsts = np.asarray(firsts, dtype=np.uint64)
    lengths = np.asarray(lengths, dtype=np.uint64)
    offsets = np.arange(chunks, dtype=np.uint64)[:, None] * np.uint64(num_pages)
    descs = np.empty((chunks * len(firsts), 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base) + (offsets + firsts[None, :]).reshape(-1) * size
    descs[:, 1] = np.tile(lengths, chunks) * size
    descs[:, 2] = device_id
    return descs


def meta_int(meta: dict, name: str, low: int = 0, high: int = 1 << 64) -> int:
    """An integer field of a peer's metadata in [low, high), else ValueError naming it."""
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise ValueError(f"the prefill worker's metadata: {name} is not an integer in "
                         f"[{low}, {high})")
    return value
