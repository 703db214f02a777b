"""A prompt step's two largest kernels, frugal's against vLLM's on the same inputs, one GPU.

At a real model's shapes (a preset or a config dir) and a step of `tokens` prompt tokens made
of prompts of --prompt-len (as a wave of concurrent prompts fills the step budget):
  - one MoE layer's experts: ops.triton.fused_moe against vLLM's `fused_experts` (its Triton
    fused_moe with the tile table vLLM ships for this GPU, else its defaults), bf16, the same
    weights, routing and inputs (vLLM's w13 is frugal's gate_up: gate rows, then up);
  - prompt attention: ops.triton.paged_attention over a bf16 paged cache (pages in random
    order) against vLLM's FlashAttention varlen (FA3 on Hopper) over contiguous K/V, causal.
Times are CUDA-graph replay medians of --calls calls, each with its own routing (MoE) so no call
finds the last one's weights in L2; TFLOP/s counts the useful products (MoE: 2 · 3 · inter ·
hidden a slot; attention: 4 · head_dim · heads a (query, allowed key) pair). vLLM comes from its
wheel set (../shared/tools/vllm_peer: PYTHONPATH=$PWD:/tmp/site); a peer that fails to import or
run prints its error in its cell.

   python benchmarks/prompt_peer.py --model qwen3-30b-a3b --tokens 2048,8192 --prompt-len 512
"""

from __future__ import annotations

import argparse
import traceback

import torch
from moe_layer import model_config
from timing import graph_time

from frugal.ops.triton.attention import paged_attention
from frugal.ops.triton.moe import fused_moe


def peer_moe():
    """vLLM's fused_experts(x, w13, w2, weights, ids) -> [T, hidden]."""
    from vllm.model_executor.layers.fused_moe import fused_experts
    return lambda x, w13, w2, weights, ids: fused_experts(x, w13, w2, weights, ids)


def peer_attention():
    """vLLM's FlashAttention varlen (FA3 where the GPU has it), causal."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def run(q, k, v, cu, max_len, scale):
        return flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=max_len, max_seqlen_k=max_len,
                                      softmax_scale=scale, causal=True, fa_version=3)
    return run


def timed(calls: list) -> str:
    """µs a call, or the error that stopped it (first line)."""
    try:
        return f"{graph_time(calls) * 1000:.1f}"
    except Exception as e:  # (a peer's API or capture refusing: say so in the table)
        traceback.print_exc()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''}"


def rate(flops: float, us: str) -> str:
    try:
        return f"{flops / float(us) / 1e6:.0f}"
    except ValueError:
        return "-"


def moe_rows(c, tokens: int, calls: int, g: torch.Generator) -> list[str]:
    m = c.moe
    e, h, i = m.num_experts, c.hidden_size, m.intermediate_size
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(0.02).bfloat16()
    w2 = torch.randn(e, h, i, device="cuda", generator=g).mul_(0.02).bfloat16()
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    weights, ids = torch.randn(tokens, e, device="cuda", generator=g).softmax(-1).topk(m.top_k)
    routings = [(weights, torch.randperm(e, device="cuda", generator=g)[ids].to(torch.int32))
                for _ in range(calls)]
    ours = timed([lambda r=r: fused_moe(x, w13, w2, r[0], r[1].long()) for r in routings])
    try:
        peer = peer_moe()
        diff = (peer(x, w13, w2, weights, routings[0][1]).float()
                - fused_moe(x, w13, w2, weights, routings[0][1].long()).float()).abs().max()
        theirs = timed([lambda r=r: peer(x, w13, w2, *r) for r in routings])
        note = f"max |diff| {diff:.2e}"
    except Exception as e:
        traceback.print_exc()
        theirs, note = f"{type(e).__name__}", ""
    flops = 2 * 3 * i * h * tokens * m.top_k
    return [f"| MoE experts | {tokens} | {ours} | {rate(flops, ours)} | {theirs} | "
            f"{rate(flops, theirs)} | {note} |"]


def attention_rows(c, tokens: int, prompt_len: int, g: torch.Generator) -> list[str]:
    heads, kv_heads, dim, page = c.num_heads, c.num_kv_heads, c.head_dim, 16
    n = max(tokens // prompt_len, 1)
    lens = [prompt_len] * n
    total = sum(lens)
    q = torch.randn(total, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, kv_heads, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    pages = total // page
    order = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)
    table = order.view(n, -1)
    k_cache = torch.empty(pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[order.long()] = k.view(pages, page, kv_heads, dim)
    v_cache[order.long()] = v.view(pages, page, kv_heads, dim)
    scale = dim ** -0.5
    ours = timed([lambda: paged_attention(q, k_cache, v_cache, table, cu, seq_lens, scale,
                                          prompt_len, prompt_len)] * 5)
    try:
        peer = peer_attention()
        diff = (peer(q, k, v, cu, prompt_len, scale).float() - paged_attention(
            q, k_cache, v_cache, table, cu, seq_lens, scale, prompt_len, prompt_len).float())
        theirs = timed([lambda: peer(q, k, v, cu, prompt_len, scale)] * 5)
        note = f"max |diff| {diff.abs().max():.2e}"
    except Exception as e:
        traceback.print_exc()
        theirs, note = f"{type(e).__name__}", ""
    flops = 4 * dim * heads * n * prompt_len * (prompt_len + 1) // 2
    return [f"| attention, {n} x {prompt_len} | {total} | {ours} | {rate(flops, ours)} | "
            f"{theirs} | {rate(flops, theirs)} | {note} |"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--calls", type=int, default=4, help="MoE calls a timing replays")
    a = p.parse_args()
    c = model_config(a.model)
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | {a.model} | bf16 | CUDA-graph replay medians, µs")
    print("| kernel | tokens | frugal µs | TFLOP/s | vLLM µs | TFLOP/s | |")
    print("|---|---|---|---|---|---|---|")
    for tokens in [int(t) for t in a.tokens.split(",")]:
        for row in moe_rows(c, tokens, a.calls, g) + attention_rows(c, tokens, a.prompt_len, g):
            print(row, flush=True)


if __name__ == "__main__":
    main()
