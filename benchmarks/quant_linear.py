"""Micro-benchmark: quantized matmuls at decode batch sizes vs torch's kernels, on one GPU.

For each shape K×N of the weight-quantization issue (and Llama-3.1-8B's gate_up, 4096×28672, which
frugal's kernels run gated: SiLU·mul fused) and M rows of activations (bf16), times
frugal's W4A16 kernel (`int4_linear`, group 128, symmetric) and FP8 paths (`fp8_linear`,
per-channel scales: W8A16, as `--scheme w8a16` checkpoints run; and W8A8, the path
`--quantization fp8` serves: x quantized per token by our kernel, then our split-K FP8 kernel,
fp8_w8a8) against, in the same run, bf16
cuBLAS (`F.linear`), FP8 `torch._scaled_mm` (per-tensor scales, M padded to 16, as
../shared/tools/gpu_peers.py measures it) and torch's INT4 tinygemm (`_weight_int4pack_mm`), and
prints µs, the weight-read bandwidth and the ratios (the JSON also has `quantize_x_us`: W8A8's
per-token quantizing kernel alone, part of its time; and `w8a8_fp8_x_us`: our W8A8 matmul from x
already in FP8, as qkv and gate_up run, their RMSNorm kernel quantizing x).
   python benchmarks/quant_linear.py [--sweep | --sweep-fp8 | --sweep-w8a8 | --centered]
                                     [--m 1,8,16,32,64]

Times are medians of CUDA-graph replays; each call reads its own copy of the weight, so nothing
is served from L2. Kernels launch in the PDL mode the server uses for quantized weights
("wait", see ops.triton.launch). --sweep times every INT4 kernel config per (shape, M) and
prints the best; --sweep-fp8 and --sweep-w8a8 do the same for the W8A16 and W8A8 kernels (and
time nothing else);
--centered times the INT4 kernel with symmetric codes as code - 8 against the MMAs with ones
for Σ x, three times each, alternating (and times nothing else).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from timing import graph_time

from frugal.ops.triton.fp8_linear import _config as fp8_config
from frugal.ops.triton.fp8_linear import fp8_linear
from frugal.ops.triton.fp8_w8a8 import _config as w8a8_config
from frugal.ops.triton.fp8_w8a8 import multiply, quantize_rows_padded, w8a8_linear
from frugal.ops.triton.int4_linear import _config, int4_linear, repack, uncentered
from frugal.ops.triton.launch import set_default
from frugal.quant.fp8 import quantize_fp8
from frugal.quant.int4 import quantize_rtn

SHAPES = [(4096, 14336), (14336, 4096), (4096, 6144), (4096, 4096)]  # (K, N)
GATE_UP = (4096, 28672)  # Llama-3.1-8B's gate_up: frugal's kernels gated (SiLU·mul fused)
CONFIGS = [c for c in itertools.product((64, 128, 256), (1, 2, 4, 8, 16), (4, 8), (3, 4, 6))
           if c[0] >= 16 * c[2]]
# (BLOCK_N, SPLIT_K, warps, STAGES) of int4_wgmma's kernel
FP8_CONFIGS = list(itertools.product((32, 64, 128), (1, 2, 4, 8), (4,), (3, 4, 6)))
# (BLOCK_N, SPLIT_K, num_warps, num_stages) of fp8_linear's W8A16 kernel (BLOCK_M from M)
W8A8_CONFIGS = [c for c in itertools.product((64, 128), (1, 2, 4, 8, 16), (4, 8), (3, 4))
                if c[0] >= 16 * c[2]]
# (BLOCK_N, SPLIT_K, num_warps, num_stages) of fp8_w8a8's kernel


def copies_for(nbytes: int) -> int:
    return min(16, max(2, -(-2**28 // nbytes)))


def bench_shape(k: int, n: int, ms: list[int], sweep: bool, gated: bool = False) -> list[dict]:
    """n: the weight's rows (gated: frugal's kernels give n / 2 outputs, SiLU·mul fused)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    copies = copies_for(n * k // 2)
    q = quantize_rtn(w, 128, symmetric=True)
    tiles = [repack(q, torch.bfloat16) for _ in range(copies)]
    dense = q.dequantize(torch.bfloat16)
    w16 = [w.clone() for _ in range(copies_for(n * k * 2))]
    scale = (w.abs().amax() / 448).float().reshape(1, 1)
    w8 = [(w / scale).to(torch.float8_e4m3fn) for _ in range(copies_for(n * k))]
    ours8 = [quantize_fp8(w) for _ in range(copies_for(n * k))]
    ours8a8 = [quantize_fp8(w, w8a8=True) for _ in range(copies_for(n * k))]
    one = torch.ones(1, 1, device="cuda")
    tiny = None
    try:  # torch's tinygemm INT4 (group 128)
        codes = q.codes()
        tiny = torch._convert_weight_to_int4pack(codes[:, ::2] << 4 | codes[:, 1::2], 8)
        sz = torch.zeros(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 (peer missing on this build)
        print(f"tinygemm unavailable: {exc!r:.100}")
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x8 = torch.zeros(max(16, m), k, device="cuda", dtype=torch.float8_e4m3fn)
        r = {"K": k, "N": n, "M": m, "gated": gated}
        r["bf16_us"] = 1e3 * graph_time([lambda i=i, x=x: F.linear(x, w16[i % len(w16)])
                                         for i in range(16)])
        r["fp8_us"] = 1e3 * graph_time([lambda i=i, x8=x8: torch._scaled_mm(
            x8, w8[i % len(w8)].t(), scale_a=one, scale_b=scale, out_dtype=torch.bfloat16)
            for i in range(16)])
        if tiny is not None:
            r["tinygemm_us"] = 1e3 * graph_time([lambda x=x: torch._weight_int4pack_mm(
                x, tiny, 128, sz)] * 4)
        r["int4_us"] = 1e3 * graph_time([lambda i=i, x=x: int4_linear(x, tiles[i % copies],
                                                                     gated=gated)
                                         for i in range(16)])
        r["ours_fp8_us"] = 1e3 * graph_time([lambda i=i, x=x: fp8_linear(x, ours8[i % len(ours8)],
                                                                         gated=gated)
                                             for i in range(16)])
        r["w8a8_us"] = 1e3 * graph_time([lambda i=i, x=x: fp8_linear(x, ours8a8[i % len(ours8a8)],
                                                                      gated=gated)
                                          for i in range(16)])
        r["quantize_x_us"] = 1e3 * graph_time([lambda x=x: quantize_rows_padded(x)] * 16)
        if m <= 64:  # qkv and gate_up as served: x quantized by the RMSNorm before them
            qx, sx = quantize_rows_padded(x)
            r["w8a8_fp8_x_us"] = 1e3 * graph_time([lambda i=i, qx=qx, sx=sx, m=m: multiply(
                qx, sx, m, ours8a8[i % len(ours8a8)], torch.bfloat16, gated=gated)
                for i in range(16)])
        r["config"] = _config(m, n // 2 if gated else n, k, gated)
        if sweep:
            outputs = n // 2 if gated else n
            configs = [c for c in CONFIGS
                       if c[1] * 2 <= k // 128 and 64 <= -(-outputs // c[0]) * c[1] <= 1200]
            times, best = time_configs(
                [tuple(r["config"]), *configs],
                lambda c, x=x: [lambda i=i: int4_linear(x, tiles[i % copies], gated=gated,
                                                        config=c) for i in range(16)])
            r["best_us"], r["best_config"], r["times"] = times[best], best, times
        ref = F.linear(x, dense)
        if gated:
            ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:]
        got = int4_linear(x, tiles[0], gated=gated)
        r["rel_err_vs_bf16"] = float((got.float() - ref.float()).norm() / ref.float().norm())
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def time_configs(configs: list[tuple], calls_for) -> tuple[dict[str, float], str]:
    """µs per call of calls_for(config) (16 calls) for each config the compiler takes, keyed by
    str(config), and the fastest's key."""
    times = {}
    for c in configs:
        try:
            times[str(c)] = 1e3 * graph_time(calls_for(c))
        except Exception as exc:  # noqa: BLE001 (a config the compiler refuses)
            print(f"config {c}: {exc!r:.80}")
    return times, min(times, key=times.get)


def sweep_fp8(k: int, n: int, ms: list[int]) -> list[dict]:
    """The W8A16 kernel's time at its own config and at each of FP8_CONFIGS."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    ours8 = [quantize_fp8(w) for _ in range(copies_for(n * k))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        own = fp8_config(m, n, k)
        times, best = time_configs(
            [(own[0], *c) for c in [own[1:], *FP8_CONFIGS]],
            lambda c, x=x: [lambda i=i: fp8_linear(x, ours8[i % len(ours8)], config=c)
                            for i in range(16)])
        r = {"K": k, "N": n, "M": m, "config": str(own), "us": times[str(own)],
             "best_config": best, "best_us": times[best]}
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def sweep_w8a8(k: int, n: int, ms: list[int], gated: bool = False) -> list[dict]:
    """The W8A8 kernel's time at its own config and at each of W8A8_CONFIGS."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    ours = [quantize_fp8(w, w8a8=True) for _ in range(copies_for(n * k))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        own = w8a8_config(m, n // 2 if gated else n, k, gated)
        times, best = time_configs(
            [own, *W8A8_CONFIGS],
            lambda c, x=x: [lambda i=i: w8a8_linear(x, ours[i % len(ours)], gated=gated,
                                                    config=c) for i in range(16)])
        r = {"K": k, "N": n, "M": m, "gated": gated, "config": str(own), "us": times[str(own)],
             "best_config": best, "best_us": times[best], "times": times}
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def ab_centered(k: int, n: int, ms: list[int], gated: bool = False) -> list[dict]:
    """Median µs of three alternating runs of each INT4 operand form at its default config:
    symmetric weights as served (code - 8, the scales alone) and as (scale, min) pairs, not
    centered (MMAs with ones for Σ x)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q = quantize_rtn(w, 128, symmetric=True)
    copies = copies_for(n * k // 2)
    tiles = [repack(q, torch.bfloat16) for _ in range(copies)]
    forms = {"ones_us": [uncentered(t) for t in tiles],
             "centered_us": tiles}
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times = {form: [] for form in forms}
        for _ in range(3):
            for form, ts in forms.items():
                times[form].append(1e3 * graph_time(
                    [lambda i=i, x=x, ts=ts: int4_linear(x, ts[i % copies], gated=gated)
                     for i in range(16)]))
        r = {"K": k, "N": n, "M": m, "gated": gated, "config": _config(m, n // 2 if gated else n,
                                                                        k, gated)}
        r.update({form: sorted(t)[1] for form, t in times.items()})
        r["speedup"] = r["ones_us"] / r["centered_us"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default="1,8,16,32,64")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-fp8", action="store_true")
    p.add_argument("--sweep-w8a8", action="store_true")
    p.add_argument("--centered", action="store_true")
    p.add_argument("--output", help="JSON of all rows")
    a = p.parse_args()
    ms = [int(m) for m in a.m.split(",")]
    set_default("wait")  # (as the model runner for quantized weights)
    if a.centered:
        rows = [r for k, n in SHAPES for r in ab_centered(k, n, ms)]
        rows += ab_centered(*GATE_UP, ms, gated=True)
        print("\n| K×N | M | config | with ones µs | code - 8 (served) µs | code - 8 speed-up |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            name = f"{r['K']}×{r['N']}" + (" gate_up" if r["gated"] else "")
            print(f"| {name} | {r['M']} | {tuple(r['config'])} | {r['ones_us']:.2f} | "
                  f"{r['centered_us']:.2f} | {r['speedup']:.2f}x |")
        save(rows, a.output)
        return
    if a.sweep_w8a8:
        rows = [r for k, n in SHAPES for r in sweep_w8a8(k, n, ms)]
        rows += sweep_w8a8(*GATE_UP, ms, gated=True)
        save(rows, a.output)
        return
    if a.sweep_fp8:
        rows = [r for k, n in SHAPES for r in sweep_fp8(k, n, ms)]
        save(rows, a.output)
        return
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA-graph replay "
          "medians | W4A16 group 128 symmetric, FP8 per-tensor\n")
    rows = [r for k, n in SHAPES for r in bench_shape(k, n, ms, a.sweep)]
    rows += bench_shape(*GATE_UP, ms, a.sweep, gated=True)
    print("\n| K×N | M | bf16 cuBLAS µs | FP8 _scaled_mm µs | tinygemm INT4 µs | frugal INT4 µs | "
          "INT4 TB/s | INT4 speed-up over FP8 | over bf16 | frugal W8A16 µs | "
          "frugal W8A8 (served) µs | served / _scaled_mm speed | W8A8 from FP8 x µs | "
          "from FP8 x / _scaled_mm speed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        nbytes = r["K"] * r["N"] / 2 + r["K"] * r["N"] / 128 * 4
        name = f"{r['K']}×{r['N']}" + (" gate_up" if r["gated"] else "")
        print(f"| {name} | {r['M']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
              f"{r.get('tinygemm_us', float('nan')):.1f} | {r['int4_us']:.1f} | "
              f"{nbytes / r['int4_us'] / 1e6:.2f} | {r['fp8_us'] / r['int4_us']:.2f}x | "
              f"{r['bf16_us'] / r['int4_us']:.2f}x | {r['ours_fp8_us']:.1f} | "
              f"{r['w8a8_us']:.1f} | {r['fp8_us'] / r['w8a8_us']:.2f}x | "
              f"{r.get('w8a8_fp8_x_us', float('nan')):.1f} | "
              f"{r['fp8_us'] / r.get('w8a8_fp8_x_us', float('nan')):.2f}x |")
    save(rows, a.output)


def save(rows: list[dict], path: str | None) -> None:
    """All rows as JSON at path (none: nothing written)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
