"""The physical KV pool: one K and one V tensor per layer, sized from a memory budget."""

from __future__ import annotations

import fcntl
import logging
import os
import weakref

import torch

from frugal.ops.torch_ref.attention import v_key_minor

logger = logging.getLogger("frugal")


class KVPool:
    """K/V storage for every layer (parts 1: one tensor a layer, v[layer] is k[layer]: MLA's
    latent cache).

    k[layer], v[layer]: [num_pages, page_size, num_kv_heads, head_dim] of `dtype` (an FP8 v:
    key-minor, [num_pages, num_kv_heads, head_dim, page_size], see torch_ref.v_key_minor). A
    token's slot is page_id * page_size + offset; `k[layer].view(-1, num_kv_heads,
    head_dim)[slot]` is its key. The pool starts zeroed, and FP8 stores saturate
    (NaN included), so no page ever holds a NaN: kernels may read a whole last page.
    shareable: a CPU pool lives in an anonymous memory file (memfd: host_shared_zeros) that a
    worker of the same user on this host may map (disagg.direct; a CUDA pool is shareable as it
    is, through CUDA IPC).
    A static FP8 pool also has scales: [num_layers, 2, num_kv_heads] fp32 (K, V), set by its
    owner before use, and scales_source saying where they came from. A row_scaled pool's 8-bit
    rows carry their scales (ops.torch_ref.kv_quant; V not key-minor). k_split (K's dtype,
    head_dim), with parts 1: each row is K's values in that dtype, then V's row (so
    k[layer] and v[layer] are strided views of one tensor). tags: [num_pages] int32, each
    page's current tag (core.page_allocator), kept up to date by the model runner.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, parts: int = 2,
                 name: str | None = None, row_scaled: bool = False,
                 k_split: tuple[torch.dtype, int] | None = None,
                 shareable: bool = False) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, parts, num_pages, page_size, num_kv_heads, head_dim)
        # Zeroed, so every page's memory is taken now (a server's footprint does not creep up
        # as pages are first written), and GPU kernels, which load whole pages under masks,
        # never meet a stale NaN.
        self.memfd: int | None = None  # (a shareable CPU pool's memory file)
        if shareable and torch.device(device).type == "cpu":
            self.memfd, memory = host_shared_zeros(num_pages * self.page_bytes(
                num_layers, page_size, num_kv_heads, head_dim, dtype, parts))
            weakref.finalize(self, os.close, self.memfd)
            self._storage = memory.view(dtype).view(shape)
        else:
            self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self._storage[i, 0] for i in range(num_layers)]
        v_shape = ((num_pages, num_kv_heads, head_dim, page_size)
                   if v_key_minor(dtype) and not row_scaled else shape[2:])
        self.v = [self._storage[i, parts - 1].view(v_shape) for i in range(num_layers)]
        if k_split is not None:
            k_dtype, dim = k_split
            k_bytes = dim * k_dtype.itemsize
            self.k = [rows.view(torch.uint8)[..., :k_bytes].view(k_dtype) for rows in self.k]
            self.v = [rows[..., k_bytes:] for rows in self.v]
        self.dtype = dtype
        self.name = name or str(dtype).removeprefix("torch.")
        if k_split is not None:  # (what a peer must match: the K bytes' dtype too)
            self.name += f" (K {str(k_split[0]).removeprefix('torch.')})"
        self.row_scaled = row_scaled
        self.tags = torch.zeros(num_pages, dtype=torch.int32, device=device)
        self.scales: torch.Tensor | None = None
        self.scales_source: str | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> dict:
        """The pool's format and where its scales come from (for /v1/models, /metrics)."""
        scales = "per token and head, in each row" if self.row_scaled else "none (not FP8)"
        return {"kv_cache_dtype": self.name, "kv_scales": self.scales_source or scales}

    @property
    def storage(self) -> torch.Tensor:
        """Every layer's pages in one tensor: [num_layers, parts, num_pages, page_size,
        num_kv_heads, head_dim]. A page is num_layers * parts contiguous chunks of
        chunk_bytes, chunk (layer, part) at ((layer * parts + part) * num_pages + page) *
        chunk_bytes from data_ptr() (what a KV transfer reads and writes)."""
        return self._storage

    @property
    def chunk_bytes(self) -> int:
        return self._storage[0, 0, 0].numel() * self._storage.element_size()

    def checksums(self, page_ids: list[int]) -> list[int]:
        """One int64 per page over every byte it holds in every layer, computed on the pool's
        device: the sum of its 32-bit words times odd weights, mod 2**64, so any one changed word
        (or chunks swapped between layers) changes it."""
        if not page_ids:
            return []
        ids = torch.tensor(page_ids, device=self._storage.device)
        num_layers, parts = self._storage.shape[:2]
        words_per_chunk = self.chunk_bytes // 4
        weights = torch.arange(num_layers * parts * words_per_chunk, device=ids.device,
                               dtype=torch.int64).mul_(2).add_(1).mul_(0x9E3779B97F4A7C15 >> 2 | 1)
        weights = weights.view(num_layers, parts, 1, words_per_chunk)
        total = torch.zeros(len(page_ids), dtype=torch.int64, device=ids.device)
        for layer in range(num_layers):
            words = self._storage[layer].index_select(1, ids).reshape(parts, len(page_ids), -1)
            words = words.view(torch.int32).to(torch.int64)
            total += (words * weights[layer]).sum(dim=(0, 2))
        return total.tolist()

    @property
    def num_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, parts: int = 2) -> int:
        """Bytes one page takes across all layers, K and V (parts 1: MLA's latent alone)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * parts * page_size * num_kv_heads * head_dim * itemsize


F_SEAL_FUTURE_WRITE = 0x10  # (Linux 5.1; not in Python's fcntl module)


def host_shared_zeros(nbytes: int) -> tuple[int, torch.Tensor]:
    """(fd, uint8 [nbytes]): zeroed host memory in an anonymous memory file that this process
    keeps open (close-on-exec: no child inherits it) and maps shared, then seals: its size can
    no longer change (a peer's mapping never loses pages under it) and, from Linux 5.1, nobody
    can open it for writing or map it writable again, this process's mapping excepted. A
    process of the same user on this host maps it read-only by opening /proc/<pid>/fd/<fd>
    (disagg.mapping). The memory is taken now, and is freed once the fd is closed and no
    mapping is left."""
    fd = os.memfd_create("frugal-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        memory = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes,
                                 dtype=torch.uint8)
        memory.zero_()
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE)
        except OSError:  # (a kernel before 5.1)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd, memory
