"""Micro-benchmark: GLM-5 decode attention, DeepSeek Sparse Attention against dense MLA, one GPU.

Per layer and decode step of `batch` requests of `context` tokens each, at GLM-5's shapes (64
heads over [512 latent | 64 rotary] rows, a 128-wide index key after them, 32 index heads,
top-2048, pages of 16): the dense MLA decode kernel over every position; the sparse path's
parts, the index scores over every position, the top-k, and MLA over the 2,048 selected
positions; and the KV bytes a token takes; for a bf16 cache and an FP8 one (latent with one
scale, index keys with one each). The query projections are the same for both paths and left
out.
   python benchmarks/sparse_attention.py
   python benchmarks/sparse_attention.py --batch 1 16 --context 2048 32768 131072
   python benchmarks/sparse_attention.py --sweep   # MLA kernel variants
   python benchmarks/sparse_attention.py --sweep-scores --batch 1 16 --context 8192 131072

Times are medians of CUDA-graph replays of 20 calls (benchmarks/timing.py), each call on its
own pages when one call's would fit in L2.
"""

from __future__ import annotations

import argparse

import torch
from timing import graph_time

from frugal.ops.triton import dsa
from frugal.ops.triton import mla_decode as mla
from frugal.ops.triton.dsa import index_scores, index_topk, sparse_mla_attention
from frugal.ops.triton.mla_decode import mla_decode
from frugal.ops.triton.topk import top_positions

LAT, ROPE, INDEX, HEADS, INDEX_HEADS, TOPK, PAGE = 512, 64, 128, 64, 32, 2048, 16
FP8_ROW = LAT + ROPE + INDEX + 16  # bytes: an FP8 index key's scale and padding after it


def caches(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 and an FP8 cache of random rows for `tokens` tokens, and the FP8 one's scales."""
    pages = -(-tokens // PAGE) + 64
    bf16 = torch.randn(pages, PAGE, 1, LAT + ROPE + INDEX, device="cuda", dtype=torch.bfloat16)
    fp8 = torch.empty(pages, PAGE, 1, FP8_ROW, device="cuda", dtype=torch.float8_e4m3fn)
    for i in range(0, pages, 4096):  # (in slices: the bf16 copy of all of it is 12 GB)
        fp8[i:i + 4096, ..., :LAT + ROPE + INDEX] = bf16[i:i + 4096].mul(64).to(fp8.dtype)
    fp8.view(torch.uint8)[..., LAT + ROPE + INDEX:LAT + ROPE + INDEX + 4] = torch.tensor(
        [1 / 64], device="cuda").view(torch.uint8)  # (each index key's scale)
    return bf16, fp8, torch.full((2, 1), 1 / 64, device="cuda")


def step(batch: int, context: int, cache: torch.Tensor) -> tuple:
    """A decode step of `batch` requests of `context` positions on `cache`: (copies, page
    tables [copies, batch, pages] (each copy on its own pages), seq_lens, cu_seqlens, q, index q,
    index weights)."""
    dev = "cuda"
    row_bytes = cache.shape[-1] * cache.element_size()
    pages_each = -(-context // PAGE)
    copies = max(1, min(20, -(-2**28 // (batch * context * row_bytes)),
                        cache.shape[0] // (batch * pages_each)))
    order = torch.randperm(cache.shape[0], device=dev)[: copies * batch * pages_each]
    tables = order.to(torch.int32).view(copies, batch, pages_each)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = torch.randn(batch, HEADS, LAT + ROPE, device=dev, dtype=torch.bfloat16)
    q_index = torch.randn(batch, INDEX_HEADS, INDEX, device=dev, dtype=torch.bfloat16)
    w = torch.randn(batch, INDEX_HEADS, device=dev) * (INDEX_HEADS * INDEX) ** -0.5
    return copies, tables, lens, cu, q, q_index, w


def score_time(batch: int, context: int, cache: torch.Tensor) -> float:
    """µs of the index scores alone (the median of CUDA-graph replays of 20 calls)."""
    copies, tables, lens, cu, _, q_index, w = step(batch, context, cache)
    keys = cache[..., LAT + ROPE:]
    return 1e3 * graph_time([lambda i=i: index_scores(q_index, w, keys, tables[i % copies], cu,
                                                      lens, context) for i in range(20)])


def bench(batch: int, context: int, cache: torch.Tensor,
          kv_scales: torch.Tensor | None = None) -> dict:
    copies, tables, lens, cu, q, q_index, w = step(batch, context, cache)
    latent, keys = cache[..., :LAT + ROPE], cache[..., LAT + ROPE:]
    scale = (192 + ROPE) ** -0.5
    selections = [index_topk(q_index, w, keys, t, cu, lens, TOPK, context) for t in tables]
    scores = index_scores(q_index, w, keys, tables[0], cu, lens, context)

    def calls(fn):
        return [lambda i=i: fn(i % copies) for i in range(20)]

    dense = graph_time(calls(lambda c: mla_decode(q, latent, tables[c], lens, scale, context,
                                                  LAT, kv_scales=kv_scales)))
    score = graph_time(calls(lambda c: index_scores(q_index, w, keys, tables[c], cu, lens,
                                                    context)))
    topk = graph_time(calls(lambda c: scores.topk(min(TOPK, context), dim=-1, sorted=False)))
    radix = graph_time(calls(lambda c: top_positions(scores, min(TOPK, context))))
    select = graph_time(calls(lambda c: index_topk(q_index, w, keys, tables[c], cu, lens, TOPK,
                                                   context)))
    attend = graph_time(calls(lambda c: sparse_mla_attention(q, latent, tables[c], cu,
                                                             selections[c], scale, LAT,
                                                             kv_scales)))
    return {k: v * 1e3 for k, v in (("dense", dense), ("score", score), ("topk", topk),
                                     ("radix", radix), ("select", select), ("attend", attend))}


# MLA kernel variants: (heads a program takes, keys an iteration, num_warps, num_stages)
SWEEP_MLA = [(64, 32, 8, 2), (32, 32, 8, 2), (16, 32, 8, 2), (32, 64, 8, 2), (16, 64, 8, 2),
             (64, 64, 8, 2), (64, 64, 8, None)]  # (stages None: Triton's default, 3)


SWEEP_INDEX = [(64, 4), (128, 4), (128, 8), (256, 4), (256, 8)]  # (BLOCK_N, num_warps)
# the score kernel's (BLOCK_N, num_warps, CHUNKS: blocks a program takes in turn)
SWEEP_SCORES = [(n, w, c) for n in (64, 128) for w in (4, 8) for c in (1, 2, 4, 8, 16)]


def sweep_scores(cache: torch.Tensor, fp8: torch.Tensor, shapes: list[tuple[int, int]],
                 variants: list[tuple[int, int, int]] = SWEEP_SCORES) -> None:
    """The index scores alone for each (BLOCK_N, warps, CHUNKS) variant at each (batch,
    context)."""
    print("| index scores: BLOCK_N | warps | CHUNKS | batch | context | bf16 | FP8 |")
    print("|---|---|---|---|---|---|---|")
    saved = dsa.BLOCK_N, dsa.NUM_WARPS, dsa.CHUNKS
    for n, warps, chunks in variants:
        dsa.BLOCK_N, dsa.NUM_WARPS, dsa.CHUNKS = n, warps, chunks
        for batch, context in shapes:
            try:
                cells = (f"{score_time(batch, context, cache):.1f} | "
                         f"{score_time(batch, context, fp8):.1f}")
            except Exception as e:  # (a variant past the GPU's resources)
                cells = f"{type(e).__name__} |"
            print(f"| {n} | {warps} | {chunks} | {batch} | {context} | {cells} |", flush=True)
    dsa.BLOCK_N, dsa.NUM_WARPS, dsa.CHUNKS = saved


def sweep(cache: torch.Tensor, fp8: torch.Tensor, scales: torch.Tensor) -> None:
    shapes = [(1, 131072), (16, 32768), (16, 131072), (64, 32768)]
    print("| heads a program | BLOCK_N | warps | stages | batch | context | dense MLA | "
          "sparse MLA |")
    print("|---|---|---|---|---|---|---|---|")
    default = mla.MAX_BLOCK_H, mla.BLOCK_N, mla.NUM_WARPS, mla.NUM_STAGES
    for h, n, warps, stages in SWEEP_MLA:
        mla.MAX_BLOCK_H, mla.BLOCK_N, mla.NUM_WARPS, mla.NUM_STAGES = h, n, warps, stages
        for batch, context in shapes:
            try:
                r = bench(batch, context, cache)
                cells = f"{r['dense']:.1f} | {r['attend']:.1f}"
            except Exception as e:  # (a variant past the GPU's resources)
                cells = f"{type(e).__name__} |"
            print(f"| {h} | {n} | {warps} | {stages} | {batch} | {context} | {cells} |",
                  flush=True)
    mla.MAX_BLOCK_H, mla.BLOCK_N, mla.NUM_WARPS, mla.NUM_STAGES = default
    print("\n| FP8: heads a program | BLOCK_N | warps | stages | batch | context | dense MLA | "
          "sparse MLA |")
    print("|---|---|---|---|---|---|---|---|")
    for h, n, warps, stages in [(64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 4, 2),
                                (64, 16, 8, 2), (64, 64, 8, None)]:
        mla.MAX_BLOCK_H, mla.BLOCK_N, mla.NUM_WARPS, mla.NUM_STAGES = h, n, warps, stages
        for batch, context in [(1, 131072), (16, 131072), (64, 32768)]:
            r = bench(batch, context, fp8, scales)
            print(f"| {h} | {n} | {warps} | {stages} | {batch} | {context} | "
                  f"{r['dense']:.1f} | {r['attend']:.1f} |", flush=True)
    mla.MAX_BLOCK_H, mla.BLOCK_N, mla.NUM_WARPS, mla.NUM_STAGES = default
    print("\n| sparse: fewest keys a split | batch | bf16 sparse MLA | FP8 sparse MLA |")
    print("|---|---|---|---|")
    saved_keys = mla.MIN_SPLIT_KEYS
    for keys in (256, 128, 64):
        mla.MIN_SPLIT_KEYS = (saved_keys[0], keys)
        for batch in (1, 16, 64):
            r, f = bench(batch, 32768, cache), bench(batch, 32768, fp8, scales)
            print(f"| {keys} | {batch} | {r['attend']:.1f} | {f['attend']:.1f} |", flush=True)
    mla.MIN_SPLIT_KEYS = saved_keys
    print()
    sweep_scores(cache, fp8, [(1, 131072), (16, 131072), (64, 131072)],
                 [(n, warps, 1) for n, warps in SWEEP_INDEX])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+",
                   default=[2048, 4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--sweep", action="store_true",
                   help="time the kernels' variants instead (SWEEP_*)")
    p.add_argument("--sweep-scores", action="store_true",
                   help="time the index score kernel's variants only (SWEEP_SCORES) at "
                        "each --batch and --context")
    a = p.parse_args()
    bf16, fp8, scales = caches(max(a.batch) * max(a.context))
    print(f"{torch.cuda.get_device_name()} | GLM-5 attention, one layer | CUDA-graph replay "
          "medians, µs\n")
    if a.sweep:
        sweep(bf16, fp8, scales)
        return
    if a.sweep_scores:
        sweep_scores(bf16, fp8, [(b, c) for b in a.batch for c in a.context])
        return
    print(f"KV bytes a token and layer: bf16 {(LAT + ROPE) * 2} latent + {INDEX * 2} index key "
          f"= {(LAT + ROPE + INDEX) * 2}; FP8 {LAT + ROPE} latent + {INDEX} index key + 16 "
          f"(its scale, padding) = {FP8_ROW}\n")
    print("| batch | context | bf16: dense MLA | index scores | top-k: torch / radix | indexer "
          "| sparse MLA "
          "(2,048) | sparse total | dense / sparse | FP8: dense MLA | indexer | sparse MLA | "
          "sparse total | dense / sparse |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in a.batch:
        for context in a.context:
            r = bench(batch, context, bf16)
            f = bench(batch, context, fp8, scales)
            total, total8 = r["select"] + r["attend"], f["select"] + f["attend"]
            print(f"| {batch} | {context} | {r['dense']:.1f} | {r['score']:.1f} | "
                  f"{r['topk']:.1f} / {r['radix']:.1f} | {r['select']:.1f} | "
                  f"{r['attend']:.1f} | {total:.1f} | "
                  f"{r['dense'] / total:.2f}x | {f['dense']:.1f} | {f['select']:.1f} | "
                  f"{f['attend']:.1f} | {total8:.1f} | {f['dense'] / total8:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
