"""Micro-benchmark: paged decode attention (Triton) vs SDPA on contiguous KV, on one GPU.

Prints time and achieved KV read bandwidth per shape for a bf16 and an FP8 (e4m3, per-head
scales) cache; SDPA (unpaged, contiguous, bf16) is the peer measured in the same run.
Llama-3.1-8B attention: 32 query heads, 8 KV heads, d=128, page 16.
   python benchmarks/decode_attention.py
   python benchmarks/decode_attention.py --sweep   # FP8 kernel: variants, two shapes

Times are medians of CUDA-graph replays of 20 calls (as the engine runs decode, and without the
host's launch cost), each call on its own copy of the KV when one copy would fit in L2.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from timing import graph_time

from frugal.ops.triton import attention, fp8_decode
from frugal.ops.triton.attention import paged_attention

SHAPES = [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 4096), (64, 16384)]


def decode_inputs(batch: int, seq_len: int, heads: int, kv_heads: int, dim: int, page: int):
    """(q, cu_seqlens, seq_lens, FP8 scales, copies of the KV to cycle through, pages a request)
    for one decode step of `batch` requests of `seq_len` tokens."""
    kv_bytes = 2 * batch * seq_len * kv_heads * dim * 2  # bf16 K and V
    copies = min(20, -(-2**28 // kv_bytes))  # together well past the 50 MB L2
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    scales = torch.full((2, kv_heads), 4.0 / 448, device="cuda")
    return q, cu, lens, scales, copies, -(-seq_len // page)


def to_fp8(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x / scales[0, 0]).clamp(-448, 448).to(torch.float8_e4m3fn)


def bench(batch: int, seq_len: int, heads: int, kv_heads: int, dim: int, page: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    kv_bytes = 2 * batch * seq_len * kv_heads * dim * 2
    q, cu, lens, scales, copies, pages_per = decode_inputs(batch, seq_len, heads, kv_heads, dim,
                                                           page)
    ours, fp8, sdpa = [], [], []
    for _ in range(copies):
        k_cache = torch.randn(batch * pages_per, page, kv_heads, dim, device=dev, dtype=dt)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * pages_per, device=dev).to(torch.int32).view(batch, -1)
        ours.append(lambda k=k_cache, v=v_cache, t=table: paged_attention(
            q, k, v, t, cu, lens, dim ** -0.5, 1, seq_len))
        k8, v8 = to_fp8(k_cache, scales), to_fp8(v_cache, scales)
        fp8.append(lambda k=k8, v=v8, t=table: paged_attention(
            q, k, v, t, cu, lens, dim ** -0.5, 1, seq_len, scales))
        kc = torch.randn(batch, kv_heads, seq_len, dim, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        sdpa.append(lambda k=kc, v=vc: F.scaled_dot_product_attention(
            q.view(batch, heads, 1, dim), k, v, enable_gqa=True))
    calls = 20
    ours_ms = graph_time([ours[i % copies] for i in range(calls)])
    fp8_ms = graph_time([fp8[i % copies] for i in range(calls)])
    attention._FP8_GLUON = False  # the Triton FP8 kernel, for contrast
    fp8_triton_ms = graph_time([fp8[i % copies] for i in range(calls)])
    attention._FP8_GLUON = True
    sdpa_ms = graph_time([sdpa[i % copies] for i in range(calls)])
    return {"batch": batch, "seq_len": seq_len, "ours_us": ours_ms * 1e3, "sdpa_us": sdpa_ms * 1e3,
            "ours_tbs": kv_bytes / ours_ms / 1e9, "sdpa_tbs": kv_bytes / sdpa_ms / 1e9,
            "fp8_us": fp8_ms * 1e3, "fp8_tbs": kv_bytes / 2 / fp8_ms / 1e9,
            "fp8_triton_us": fp8_triton_ms * 1e3}


# FP8 decode kernel variants: 16-key blocks per inner step, and the split count (None: the
# kernel's own, one wave of programs)
SWEEP_PAGES = [1, 2, 4]
SWEEP_SPLITS = [None, 1, 2, 3, 4, 6, 8, 16, 64]
SWEEP_SHAPES = [(1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 4096)]


def sweep(heads: int, kv_heads: int, dim: int, page: int) -> None:
    """Time the FP8 decode kernel under each variant (module settings patched)."""
    print("| batch | seq_len | pages per step | splits | µs | FP8 TB/s |")
    print("|---|---|---|---|---|---|")
    default = (fp8_decode.PAGES, fp8_decode.split_count)
    for batch, seq_len in SWEEP_SHAPES:
        kv_bytes = batch * seq_len * kv_heads * dim * 2  # FP8 K and V
        q, cu, lens, scales, copies, pages_per = decode_inputs(batch, seq_len, heads, kv_heads,
                                                               dim, page)
        caches = []
        for _ in range(copies):
            shape = (batch * pages_per, page, kv_heads, dim)
            k, v = (to_fp8(torch.randn(shape, device="cuda", dtype=torch.bfloat16), scales)
                    for _ in range(2))
            table = torch.randperm(batch * pages_per, device="cuda").to(torch.int32).view(batch, -1)
            caches.append((k, v, table))
        calls = [functools.partial(paged_attention, q, k, v, t, cu, lens, dim ** -0.5, 1,
                                   seq_len, scales)
                 for k, v, t in (caches[i % copies] for i in range(20))]
        for pages, splits in itertools.product(SWEEP_PAGES, SWEEP_SPLITS):
            fp8_decode.PAGES = pages
            fp8_decode.split_count = default[1] if splits is None else lambda *_, n=splits: n
            ms = graph_time(calls)
            shown = (default[1](batch, kv_heads, seq_len, q.device, attention._MAX_SPLITS)
                     if splits is None else splits)
            print(f"| {batch} | {seq_len} | {pages} | {shown}{'' if splits else ' (own)'} | "
                  f"{ms * 1e3:.1f} | {kv_bytes / ms / 1e9:.2f} |", flush=True)
        fp8_decode.PAGES, fp8_decode.split_count = default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sweep", action="store_true",
                   help="time the FP8 kernel's launch variants instead (SWEEP_* above)")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()} | {a.heads}/{a.kv_heads} heads, d={a.head_dim}, "
          f"page {a.page_size}, bf16 queries | CUDA-graph replay medians\n")
    if a.sweep:
        sweep(a.heads, a.kv_heads, a.head_dim, a.page_size)
        return
    print("| batch | seq_len | frugal bf16 µs | TB/s | SDPA contiguous µs | SDPA TB/s | "
          "SDPA / frugal | frugal FP8 µs | FP8 TB/s | FP8 speed-up over bf16 | "
          "Triton FP8 kernel µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, seq_len in SHAPES:
        r = bench(batch, seq_len, a.heads, a.kv_heads, a.head_dim, a.page_size)
        print(f"| {batch} | {seq_len} | {r['ours_us']:.1f} | {r['ours_tbs']:.2f} | "
              f"{r['sdpa_us']:.1f} | {r['sdpa_tbs']:.2f} | {r['sdpa_us'] / r['ours_us']:.2f}x | "
              f"{r['fp8_us']:.1f} | {r['fp8_tbs']:.2f} | {r['ours_us'] / r['fp8_us']:.2f}x | "
              f"{r['fp8_triton_us']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
