"""Micro-benchmark: paged prefill/extend attention (Triton), bf16 and FP8 caches, on one GPU.

Llama-3.1-8B attention (32 query heads, 8 KV heads, d=128, page 16). Shapes: prompt chunks of
2,048 tokens (the engine's default step budget) at the start of a prompt and after 2,048 cached
tokens, four 512-token prompts, and a mixed step (one 2,048-token chunk with 63 decodes of 4,096
cached tokens each, as chunked prefill batches them: the decodes first, as the scheduler orders
them, so they run in the decode kernel), and 16 prompts of 128 new tokens each after a 2,048-token
prefix the prefix cache held, and 16 prompts of 512 (a wave of concurrent prompts filling an
8,192-token step). SDPA (flash, causal, contiguous bf16) is
the peer where a chunk starts a prompt. Causal FLOPs: 4 · d · heads per (query, allowed key).
--kv-heads 4: Qwen3-30B-A3B's groups of 8 query heads.
   python benchmarks/extend_attention.py [--kv-heads 8]
   python benchmarks/extend_attention.py --sweep   # launch variants (rows, keys, warps, stages)
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from decode_attention import to_fp8
from timing import graph_time

from frugal.ops.triton import attention
from frugal.ops.triton.attention import paged_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
# (name, [(cached tokens before the step, new tokens)] per request)
SHAPES = [("chunk at 0", [(0, 2048)]), ("chunk at 2048", [(2048, 2048)]),
          ("4 prompts of 512", [(0, 512)] * 4),
          ("63 decodes + chunk", [(4095, 1)] * 63 + [(2048, 2048)]),
          ("16 prefix hits: 128 after 2048", [(2048, 128)] * 16),
          ("16 prompts of 512", [(0, 512)] * 16)]
SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 1), (128, 64, 4, 1), (128, 64, 4, 2),
         (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (256, 64, 8, 1), (256, 64, 8, 2),
         (64, 128, 4, 2), (64, 32, 4, 2), (128, 64, 8, 3), (256, 64, 8, 3), (128, 32, 4, 2)]


def case(requests: list[tuple[int, int]], fp8: bool):
    """(call, FLOPs) of one paged_attention step over random caches."""
    dev = "cuda"
    lens = [c + n for c, n in requests]
    pages = [-(-n // PAGE) for n in lens]
    q = torch.randn(sum(n for _, n in requests), HEADS, DIM, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0] + [n for _, n in requests], device=dev).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    table = torch.zeros(len(requests), max(pages), dtype=torch.int32, device=dev)
    perm = torch.randperm(sum(pages), device=dev).to(torch.int32)
    for i, (first, n) in enumerate(zip([0] + list(torch.tensor(pages).cumsum(0)[:-1]), pages)):
        table[i, :n] = perm[first:first + n]
    k = torch.randn(sum(pages), PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scales = None
    if fp8:
        scales = torch.full((2, KV_HEADS), 4.0 / 448, device=dev)
        k, v = to_fp8(k, scales), to_fp8(v, scales).permute(0, 2, 3, 1).contiguous()
    decodes = next((i for i, (_, n) in enumerate(requests) if n != 1), len(requests))
    call = functools.partial(paged_attention, q, k, v, table, cu, seq_lens, DIM ** -0.5,
                             max(n for _, n in requests), max(lens), scales, decodes)
    flops = sum(4 * DIM * HEADS * sum(c + j + 1 for j in range(n)) for c, n in requests)
    return call, flops


def sdpa(n: int):
    q = torch.randn(1, HEADS, n, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, n, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def main() -> None:
    global KV_HEADS
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sweep", action="store_true", help="time the launch variants (SWEEP)")
    p.add_argument("--kv-heads", type=int, default=KV_HEADS, help="of the 32 query heads")
    p.add_argument("--shapes", default="", help="only the shapes whose names contain this")
    p.add_argument("--bf16-only", action="store_true", help="sweep the bf16 cache alone")
    a = p.parse_args()
    KV_HEADS = a.kv_heads
    shapes = [(name, r) for name, r in SHAPES if a.shapes in name]
    print(f"{torch.cuda.get_device_name()} | {HEADS}/{KV_HEADS} heads, d={DIM}, page {PAGE}, "
          f"bf16 queries | CUDA-graph replay medians\n")
    if a.sweep:
        default = attention._EXTEND_LAUNCH, attention._FP8_EXTEND_LAUNCH
        print("| shape | cache | rows | keys per block | warps | stages | µs | TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, requests in shapes:
            for fp8 in (False,) if a.bf16_only else (False, True):
                call, flops = case(requests, fp8)
                for rows, block_n, warps, stages in SWEEP:
                    variant = {rows: {"BLOCK_N": block_n, "num_warps": warps,
                                      "num_stages": stages}, 16: default[0][16]}
                    attention._EXTEND_LAUNCH = attention._FP8_EXTEND_LAUNCH = variant
                    ms = graph_time([call] * 5)
                    print(f"| {name} | {'fp8' if fp8 else 'bf16'} | {rows} | {block_n} | {warps} "
                          f"| {stages} | {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} |", flush=True)
        attention._EXTEND_LAUNCH, attention._FP8_EXTEND_LAUNCH = default
        return
    print("| shape | bf16 µs | TFLOP/s | FP8 µs | TFLOP/s | FP8 speed over bf16 | SDPA µs | "
          "SDPA / frugal bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, requests in shapes:
        (bf16, flops), (fp8, _) = case(requests, False), case(requests, True)
        bf16_ms, fp8_ms = graph_time([bf16] * 5), graph_time([fp8] * 5)
        peer = "n/a"
        if len(requests) == 1 and requests[0][0] == 0:
            peer_ms = graph_time([sdpa(requests[0][1])] * 5)
            peer = f"{peer_ms * 1e3:.1f} | {peer_ms / bf16_ms:.2f}x"
        else:
            peer += " | n/a"
        print(f"| {name} | {bf16_ms * 1e3:.1f} | {flops / bf16_ms / 1e9:.0f} | {fp8_ms * 1e3:.1f} "
              f"| {flops / fp8_ms / 1e9:.0f} | {bf16_ms / fp8_ms:.2f}x | {peer} |", flush=True)


if __name__ == "__main__":
    main()
