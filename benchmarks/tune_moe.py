"""Tune the fused MoE kernels' tiles on this GPU and write them into the table the kernels read
(frugal/ops/triton/moe_configs.json, under the GPU's name).

For each expert matrix of a model (gate_up, gated; down, routed), each weight form (bf16, FP8
128x128 blocks, INT4 group 32) and each number of slots (tokens x top_k, powers of two): every
candidate configuration of the path fused_moe takes at that many slots (the small-batch GEMV up
to moe_gemv.MAX_SLOTS, the sorted grouped GEMM past it) is timed from a CUDA graph of --calls
launches, each routing to other experts (as moe_layer.py times), checked against the default
configuration's output, and the fastest kept where it beats the default, what the table gives
already (this GPU's entry, else one of a GPU of its compute capability, else the kernels'
defaults) (GEMV candidates with the K loop pipelined in STAGES or not, INT4 also with
PREFETCH). Prints a table of the default and tuned microseconds.

    python benchmarks/tune_moe.py --model qwen3-30b-a3b [--tokens 1,2,4,8,16,32,64,128,256]
        [--forms bf16,fp8,int4,fp8_w8a8] [--output frugal/ops/triton/moe_configs.json] [--experts N]
        [--calls 16]
--model and --experts as in moe_layer.py (a config directory: .peer/models/kimi-k2-4l).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from moe_layer import model_config, timed

from frugal.ops.triton import moe, moe_configs, moe_dense, moe_gemv
from frugal.quant.experts import quantize_experts

# (8 warps never won at Qwen3-30B-A3B's shapes on the H200: left out; BLOCK_N 64 did not win
# for the GEMV before its INT4 rewrite, whose threads now share each input across their rows)
GEMV = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
        for n, k, w in itertools.product((8, 16, 32, 64), (64, 128, 256, 512), (1, 2, 4))]
# the K loop pipelined by Triton (STAGES, every form) or INT4's steps loaded ahead (PREFETCH),
# on the tiles that won at Qwen3-30B-A3B's and Kimi K2's shapes on an H100 and the H200
NARROW = [c for c in GEMV if c["BLOCK_N"] <= 32 and c["BLOCK_K"] >= 128]
GEMV_PIPELINED = GEMV + [{**c, "STAGES": s} for s in (2, 3) for c in NARROW]
# INT4 at one token is bound by latency, not instructions (Qwen3-30B-A3B's gate_up: 9.8 us on
# the H200 where 4.2 instructions a weight allow ~3): K steps of up to a whole row's words, all
# in flight at once
GEMV_INT4 = (GEMV_PIPELINED + [{**c, "PREFETCH": d} for d in (1, 2) for c in NARROW]
             + [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
                for n, k, w in itertools.product((8, 16), (1024, 2048), (2, 4, 8))])
SORTED = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
          for n, k, w, s in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
# prompts (experts averaging 16 slots or more): the block's rows too, and wider tiles in fewer
# variants (as vLLM's tables pick for thousands of tokens: 64-128 rows, 128-256 outputs, K steps
# of 64, 8 warps, 3-4 stages)
WIDE = [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
        for m, n, k, w, s in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (64, 128),
                                               (4, 8), (2, 3, 4))]


def sorted_candidates(slots: int, num_experts: int, gated: bool) -> list[dict]:
    """The sorted path's candidates at this many slots: SORTED (the alignment's own BLOCK_M)
    while experts average under 16 slots; past it, WIDE's rows near the average (from a quarter
    of it, up to twice it) whose tiles fit: the pipeline's stages in ~200 KB of shared memory,
    the fp32 accumulators (two when gated) in 128 registers a thread."""
    avg = slots / num_experts
    if avg < 16:
        return SORTED
    acc = 2 if gated else 1
    return [c for c in WIDE
            if min(64, avg / 4) <= c["BLOCK_M"] <= 2 * avg
            and (c["BLOCK_M"] >= 64 or (c["num_warps"] == 4 and c["BLOCK_N"] <= 128))
            and (c["BLOCK_M"] < 64 or c["num_stages"] >= 3)
            and c["num_stages"] * (c["BLOCK_M"] + acc * c["BLOCK_N"]) * c["BLOCK_K"] * 2
            <= 200 * 1024
            and acc * c["BLOCK_M"] * c["BLOCK_N"] <= 128 * 32 * c["num_warps"]]


def runner(w, n: int, x: torch.Tensor, ids: torch.Tensor, route: torch.Tensor | None,
           a_div: int):
    """A function (config or None) -> output of one matrix's launch on the path these slots
    take."""
    slots = ids.numel()
    out = torch.empty(slots, n, dtype=torch.float32 if route is not None else x.dtype,
                      device=x.device)
    if slots <= moe_gemv.MAX_SLOTS:
        flat = ids.reshape(-1).contiguous()
        return "gemv", lambda c, block_m=None: (moe_gemv._launch(x, w, out, n, flat, route,
                                                                 a_div, c) or out)
    # (aligned for every BLOCK_M beforehand: a timing's graph holds the GEMMs alone)
    aligned = {b: moe.align(ids, w.shape[0], b) for b in moe_configs.OPTIONAL["sorted"]["BLOCK_M"]}
    out = out.to(x.dtype)

    _, _, mode, _, scale_k, k = moe._operand(w)

    def run(c, block_m=None):
        """block_m: the rows the alignment's blocks hold (default: the config's, else the
        table's as fused_moe reads it), the config's tiles only if it agrees."""
        table = c or moe_configs.lookup(x.device, "sorted", mode, n, k, slots, scale_k)
        block_m = block_m or moe.rows_per_block(slots, w.shape[0], table)
        return moe._gemm(x, w, out, n, *aligned[block_m], route, a_div, block_m, c) or out

    return "sorted", run


def tune(path: str, runs: list, mode: int, scale_k: int, k: int, candidates: list[dict],
         block_m: int | None = None) -> tuple[dict, float, float]:
    """(best config, its us, the default's us) among the valid candidates; runs: one launch
    function (runner's) per routing. block_m: the sorted path's alignment is fixed (down
    follows gate_up's): the default's tiles at it, and only candidates that agree."""
    run = runs[0]
    want = run(None, block_m).clone()
    default = timed([lambda r=r: r(None, block_m) for r in runs])
    best, best_us = None, float("inf")
    for config in candidates:
        if not moe_configs.tiles_scales(mode, config["BLOCK_K"], scale_k, k):
            continue
        if mode == 3 and not moe_configs.w8a8_tile(path, config["BLOCK_K"], config["BLOCK_N"],
                                                   config.get("BLOCK_M", block_m or 16)):
            continue  # (moe._gemm would run its default)
        if block_m is not None:  # (down: at gate_up's rows, stated in the entry)
            if config.get("BLOCK_M", block_m) != block_m:
                continue
            config = {**config, "BLOCK_M": block_m}
        try:
            got = run(config)
            if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
                continue
            us = timed([lambda r=r, c=config: r(c) for r in runs])
        except Exception:  # (out of shared memory or registers at this shape)
            continue
        if us < best_us:
            best, best_us = config, us
    return best, best_us, default


def save(table: dict, path: str) -> None:
    """Write the table whole or not at all (a run killed mid-write leaves the old file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--forms", default="bf16,fp8,int4")
    p.add_argument("--output", default=str(moe_configs.TABLE))
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--quick", action="store_true",
                   help="prompt sizes: only the wide tiles of K steps of 64 and 8 warps "
                        "(vLLM's tables' picks there; a fifth of the candidates)")
    args = p.parse_args()
    c = model_config(args.model)
    m, h = c.moe, c.hidden_size
    e, i = args.experts or m.num_experts, m.intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=g).mul_(0.02).bfloat16()
    down = torch.randn(e, h, i, device="cuda", generator=g).mul_(0.02).bfloat16()
    device = torch.cuda.get_device_name()
    try:
        with open(args.output) as f:
            table = json.load(f)
    except FileNotFoundError:
        table = {}
    entries = table.setdefault(device, {})
    entries[moe_configs.CAPABILITY] = moe_configs.capability(torch.device("cuda"))
    print(f"{args.model} on {device}: {e} experts, top {m.top_k}, hidden {h}, inter {i}")
    print("| form | matrix | tokens | path | default us | tuned us | config |")
    print("|---|---|---|---|---|---|---|")
    for form in args.forms.split(","):
        scheme, w8a8 = form.removesuffix("_w8a8"), form.endswith("_w8a8")
        mats = ((gate_up, down) if form == "bf16" else
                (quantize_experts(gate_up, scheme, w8a8), quantize_experts(down, scheme, w8a8)))
        for t in [int(s) for s in args.tokens.split(",")]:
            x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
            weights, ids = torch.randn(t, e, device="cuda", generator=g).softmax(-1).topk(m.top_k)
            act = torch.randn(t * m.top_k, i, device="cuda", generator=g).bfloat16()
            route = weights.reshape(-1).float().contiguous()
            perms = [torch.randperm(e, device="cuda", generator=g) for _ in range(args.calls)]
            block_m = None  # (down's alignment: gate_up's)
            for name, w, n, a, rt, div in (("gate_up", mats[0], i, x, None, m.top_k),
                                            ("down", mats[1], h, act, route, 1)):
                _, _, mode, _, scale_k, k = moe._operand(w)
                if moe_dense.takes(w, t * m.top_k):  # (dequantized first: bf16's tiles)
                    print(f"| {form} | {name} | {t} | dequantized, as bf16 | | | |")
                    continue
                runs = [runner(w, n, a, perm[ids], rt, div) for perm in perms]
                path = runs[0][0]
                candidates = ((GEMV_INT4 if mode == 2 else GEMV_PIPELINED) if path == "gemv"
                              else sorted_candidates(t * m.top_k, e, rt is None))
                if args.quick and candidates is not SORTED and path == "sorted":
                    candidates = [c for c in candidates
                                  if c["BLOCK_K"] == 64 and c["num_warps"] == 8]
                best, us, default = tune(path, [r for _, r in runs], mode, scale_k, k,
                                         candidates, block_m)
                entry = moe_configs.key(path, mode, n, k, t * m.top_k)
                if best is not None and us < default:
                    entries[entry] = best
                if path == "sorted":  # (what fused_moe will align gate_up's slots by: the
                    # entry kept, else the table's, maybe another GPU's of this capability)
                    block_m = moe.rows_per_block(t * m.top_k, e, entries.get(entry) or (
                        moe_configs.lookup(a.device, path, mode, n, k, t * m.top_k, scale_k)))
                print(f"| {form} | {name} | {t} | {path} | {default:.1f} | {us:.1f} | "
                      f"{best} |", flush=True)
                save(table, args.output)  # (a cut-off run keeps what it found)
    experts = f" --experts {args.experts}" if args.experts else ""
    print(f"command: python benchmarks/tune_moe.py --model {args.model}{experts} --tokens "
          f"{args.tokens} --forms {args.forms} --calls {args.calls}"
          f"{' --quick' if args.quick else ''}")


if __name__ == "__main__":
    main()
