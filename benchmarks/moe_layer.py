"""Time one MoE layer's experts (ops.triton.fused_moe) at a real model's shapes, by tokens per
step, float / FP8-block (activations kept, and W8A8) / INT4 experts, against the per-expert
PyTorch loop (torch_ref), and print a table: microseconds per call and the weight bytes read per
microsecond (the experts a step touches, each read once, with their scales: TB/s). A time is
that of --calls calls replayed from one CUDA graph, each routing the tokens to other experts
(the routing permuted), as consecutive layers read other weights: neither a graph launch nor
weights still in L2 from the call before count (FP8 and INT4 experts of one Qwen3 step fit the
L2). Up to moe_gemv.MAX_SLOTS slots fused_moe takes the small-batch path (each slot reads its
expert, no sort); --sorted times the sorted grouped GEMMs there too, and the routing kernel
(ops.triton.moe_route) against the torch ops it replaces is timed beside them. Where INT4
experts are dequantized first (ops.triton.moe_dense), their time widened in registers is given
beside it; --int4-pairs times the INT4 experts with (scale, min) pairs too (their scales alone
are the default for symmetric codes).

    python benchmarks/moe_layer.py [--model qwen3-30b-a3b] [--tokens 1,8,32,64,256,2048]
        [--experts N] [--calls 16] [--sorted] [--int4-pairs]
--model: a preset (qwen3-30b-a3b, glm-4.5-air) or a directory with a config.json
(.peer/models/kimi-k2-4l); --experts: stack only N experts (the time depends on the experts a
step touches, not on how many there are: Kimi K2's 384 in bf16 are 34 GB).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from timing import graph_time

from frugal.loader.dummy import PRESETS
from frugal.model_config import ModelConfig
from frugal.ops import torch_ref
from frugal.ops.triton import moe_dense, moe_gemv, pack_experts
from frugal.ops.triton.int4_linear import uncentered
from frugal.ops.triton.moe import _operand, fused_moe
from frugal.ops.triton.moe_int4_tiles import Int4ExpertTiles
from frugal.ops.triton.moe_route import route_experts
from frugal.quant.experts import quantize_experts


def model_config(name: str) -> ModelConfig:
    """A preset's config, or that of a directory's config.json."""
    path = pathlib.Path(name) / "config.json"
    return ModelConfig.from_hf(json.loads(path.read_text()) if path.is_file() else PRESETS[name])


def timed(fns: list) -> float:
    """Microseconds per call of fns replayed in one CUDA graph (timing.graph_time's median)."""
    return graph_time(fns) * 1000


def _expert_bytes(w) -> int:
    """Bytes of one expert's matrix as the kernels read it: the weights and, quantized, their
    scales."""
    data, scales, mode, *_ = _operand(w)
    return data[0].nbytes + (scales[0].nbytes if mode else 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,32,64,256,2048")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--calls", type=int, default=16,
                   help="calls a timing replays, each with its own routing")
    p.add_argument("--sorted", action="store_true",
                   help="also time the sorted path where the small-batch path runs")
    p.add_argument("--int4-pairs", action="store_true",
                   help="also time INT4 experts with (scale, min) pairs, not scales alone")
    args = p.parse_args()
    c = model_config(args.model)
    m = c.moe
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = args.experts or m.num_experts, c.hidden_size, m.intermediate_size
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(0.02).bfloat16()
    down = torch.randn(e, h, i, device="cuda", generator=g).mul_(0.02).bfloat16()
    forms = {"bf16": (gate_up, down),
             "fp8": (quantize_experts(gate_up, "fp8"), quantize_experts(down, "fp8")),
             "int4": tuple(pack_experts(quantize_experts(w, "int4"), w.dtype)
                           for w in (gate_up, down)),  # (as the worker packs them)
             "fp8_w8a8": (quantize_experts(gate_up, "fp8", w8a8=True),
                          quantize_experts(down, "fp8", w8a8=True))}
    if args.int4_pairs:  # (what experts keep whose mins are not all -8 · scale)
        forms["int4_pairs"] = tuple(uncentered(w) if isinstance(w, Int4ExpertTiles) else w
                                    for w in forms["int4"])
    # one expert's bytes in each form: its weights (packed INT4 words) and their scales
    expert_bytes = {name: sum(_expert_bytes(w) for w in pair) for name, pair in forms.items()}
    rows = []
    print(f"{args.model}: {e} experts, top {m.top_k}, hidden {h}, expert inter {i}; us per layer "
          f"(CUDA graph) on {torch.cuda.get_device_name()}")
    print("| tokens | experts hit | torch_ref bf16 | frugal bf16 | frugal FP8 | frugal INT4 | "
          "frugal FP8 W8A8 | TB/s bf16 / FP8 / INT4 / W8A8 | route: torch ops / kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    router_w = torch.randn(e, h, device="cuda", generator=g).mul_(0.02).bfloat16()
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        router = torch.randn(t, e, device="cuda", generator=g)
        weights, ids = router.softmax(-1).topk(m.top_k, dim=-1)
        hit = int(ids.unique().numel())
        perms = [torch.randperm(e, device="cuda", generator=g) for _ in range(args.calls)]
        routings = [(weights, perm[ids]) for perm in perms]
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
            calls = [lambda a=(x, gu, dn, wts, eids): fused_moe(*a) for wts, eids in routings]
            row[f"{name}_us"] = timed(calls)
            row[f"{name}_tbs"] = hit * expert_bytes[name] / row[f"{name}_us"] / 1e6
            if args.sorted and t * m.top_k <= moe_gemv.MAX_SLOTS:
                limit, moe_gemv.MAX_SLOTS = moe_gemv.MAX_SLOTS, 0
                row[f"{name}_sorted_us"] = timed(calls)
                moe_gemv.MAX_SLOTS = limit
            if moe_dense.takes(gu, t * m.top_k):  # (and widened in registers, as below it)
                limit, moe_dense.DENSE_SLOTS = moe_dense.DENSE_SLOTS, float("inf")
                row[f"{name}_registers_us"] = timed(calls)
                moe_dense.DENSE_SLOTS = limit
        bias = torch.zeros(e, device="cuda") if m.correction_bias else None
        route = (x, router_w, bias, m.top_k, m.scoring, m.norm_topk_prob, m.n_group,
                 m.topk_group, m.routed_scaling_factor)
        row["route_torch_us"] = timed([lambda r=route: torch_ref.route_experts(*r)] * args.calls)
        row["route_kernel_us"] = timed([lambda r=route: route_experts(*r)] * args.calls)
        rows.append(row)
        ref = row.get("torch_ref_bf16_us")
        sorted_ = "".join(f" (sorted {row[k + '_sorted_us']:.1f})" if k + "_sorted_us" in row
                          else "" for k in ("bf16",))
        registers = (f" (in registers {row['int4_registers_us']:.1f})"
                     if "int4_registers_us" in row else "")
        registers += f" (pairs {row['int4_pairs_us']:.1f})" if "int4_pairs_us" in row else ""
        print(f"| {t} | {hit} | {'-' if ref is None else f'{ref:.0f}'} | "
              f"{row['bf16_us']:.1f}{sorted_} | {row['fp8_us']:.1f} | "
              f"{row['int4_us']:.1f}{registers} | {row['fp8_w8a8_us']:.1f} | "
              f"{row['bf16_tbs']:.2f} / {row['fp8_tbs']:.2f} / {row['int4_tbs']:.2f} / "
              f"{row['fp8_w8a8_tbs']:.2f} | "
              f"{row['route_torch_us']:.1f} / {row['route_kernel_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
