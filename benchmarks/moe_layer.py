"""Time one MoE layer's experts (ops.triton.fused_moe) at a real model's shapes, by tokens per
step, float / FP8-block / INT4 experts, against the per-expert PyTorch loop (torch_ref), and
print a table: microseconds per call, CUDA-graph replayed, and the weight bytes read per
microsecond (the experts a step touches, each read once).

    python benchmarks/moe_layer.py [--model qwen3-30b-a3b] [--tokens 1,8,32,64,256,2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from frugal.loader.dummy import PRESETS
from frugal.model_config import ModelConfig
from frugal.ops import torch_ref
from frugal.ops.triton.moe import fused_moe
from frugal.quant.experts import quantize_experts


def timed(fn, reps: int = 20) -> float:
    """Microseconds per call of fn replayed from a CUDA graph."""
    fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "glm-4.5-air"])
    p.add_argument("--tokens", default="1,8,32,64,256,2048")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    c = ModelConfig.from_hf(PRESETS[args.model])
    m = c.moe
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = m.num_experts, c.hidden_size, m.intermediate_size
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(0.02).bfloat16()
    down = torch.randn(e, h, i, device="cuda", generator=g).mul_(0.02).bfloat16()
    forms = {"bf16": (gate_up, down),
             "fp8": (quantize_experts(gate_up, "fp8"), quantize_experts(down, "fp8")),
             "int4": (quantize_experts(gate_up, "int4"), quantize_experts(down, "int4"))}
    bytes_per = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}
    rows = []
    print(f"{args.model}: {e} experts, top {m.top_k}, hidden {h}, expert inter {i}; H200 us per "
          "layer (CUDA graph)")
    print("| tokens | experts hit | torch_ref bf16 | frugal bf16 | frugal FP8 | frugal INT4 | "
          "INT4 GB/s |")
    print("|---|---|---|---|---|---|---|")
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        router = torch.randn(t, e, device="cuda", generator=g)
        weights, ids = router.softmax(-1).topk(m.top_k, dim=-1)
        hit = int(ids.unique().numel())
        row = {"tokens": t, "experts_hit": hit}
        if t <= 64:  # (the loop's .unique() and nonzero sync: time it eagerly)
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(5):
                torch_ref.fused_moe(x, gate_up, down, weights, ids)
            ev1.record()
            torch.cuda.synchronize()
            row["torch_ref_bf16_us"] = ev0.elapsed_time(ev1) * 1000 / 5
        for name, (gu, dn) in forms.items():
            args_ = (x, gu, dn, weights, ids)
            row[f"{name}_us"] = timed(lambda a=args_: fused_moe(*a))
        touched = hit * 3 * h * i * bytes_per["int4"]
        row["int4_gbs"] = touched / row["int4_us"] / 1e3
        rows.append(row)
        ref = row.get("torch_ref_bf16_us")
        print(f"| {t} | {hit} | {'-' if ref is None else f'{ref:.0f}'} | {row['bf16_us']:.1f} | "
              f"{row['fp8_us']:.1f} | {row['int4_us']:.1f} | {row['int4_gbs']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
