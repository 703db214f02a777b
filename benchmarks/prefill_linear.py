"""Micro-benchmark: quantized matmuls at prefill sizes (hundreds to thousands of rows) vs torch's
kernels, on one GPU.

For each shape K×N of the weight-quantization issue (and Llama-3.1-8B's gate_up, 4096×28672, run
plain here) and M rows of bf16 activations, times in one run:
  - bf16 cuBLAS (`F.linear`) and FP8 `torch._scaled_mm` with row-wise scales (x already in
    e4m3: the matmul alone), the peers;
  - frugal's FP8 path for prefill (`fp8_linear`, W8A8: x quantized per token, then
    `_scaled_mm`);
  - frugal's INT4 paths: W4A16 (the weight dequantized for cuBLAS) and W4A8 (`int4_linear`:
    x quantized per row and 128-input tile, the weight's codes unpacked to e4m3, then
    `_scaled_mm` with block-wise scales), and W4A8's unpacking alone;
and prints µs, TFLOP/s and the ratios, and W4A8's error against the W4A16 product.
   python benchmarks/prefill_linear.py [--m 512,2048,8192]

Times are medians of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from timing import graph_time

from frugal.ops.triton.fp8_linear import fp8_linear
from frugal.ops.triton.int4_linear import dequantize, int4_linear, repack
from frugal.ops.triton.int4_prefill import codes
from frugal.quant.fp8 import quantize_fp8, quantize_rows
from frugal.quant.int4 import quantize_rtn

SHAPES = [(4096, 14336), (14336, 4096), (4096, 6144), (4096, 4096), (4096, 28672)]  # (K, N)


def bench_shape(k: int, n: int, ms: list[int]) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q = quantize_rtn(w, 128, symmetric=True)
    tiles = repack(q, torch.bfloat16)
    dense = q.dequantize(torch.bfloat16)
    w8 = quantize_fp8(w, w8a8=True)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x8, s8 = quantize_rows(x)
        r = {"K": k, "N": n, "M": m}
        time = {
            "bf16": lambda x=x: F.linear(x, w),
            "scaled_mm": lambda x8=x8, s8=s8: torch._scaled_mm(
                x8, w8.data.t(), scale_a=s8, scale_b=w8.scales.t(), out_dtype=torch.bfloat16),
            "fp8_served": lambda x=x: fp8_linear(x, w8),
            "w4a16": lambda x=x: F.linear(x, dequantize(tiles, torch.bfloat16)),
            "w4a8": lambda x=x: int4_linear(x, tiles),
            "codes": lambda: codes(tiles.words),
        }
        for name, fn in time.items():
            r[f"{name}_us"] = 1e3 * graph_time([fn] * 4)
        ref = F.linear(x, dense).float()
        got = int4_linear(x, tiles).float()
        r["w4a8_rel_err_vs_w4a16"] = float((got - ref).norm() / ref.norm())
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default="512,2048,8192")
    p.add_argument("--output", help="JSON of all rows")
    a = p.parse_args()
    ms = [int(m) for m in a.m.split(",")]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA-graph replay "
          "medians | INT4 group 128 symmetric, FP8 row-wise\n")
    rows = [r for k, n in SHAPES for r in bench_shape(k, n, ms)]
    print("\n| K×N | M | bf16 µs | FP8 _scaled_mm µs | frugal FP8 µs | INT4 W4A16 µs | "
          "INT4 W4A8 µs | W4A8 unpacking µs | W4A8 TFLOP/s | W4A8 / frugal FP8 speed | "
          "W4A8 / W4A16 speed | W4A8 error vs W4A16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tflops = 2 * r["M"] * r["N"] * r["K"] / r["w4a8_us"] / 1e6
        print(f"| {r['K']}×{r['N']} | {r['M']} | {r['bf16_us']:.1f} | {r['scaled_mm_us']:.1f} | "
              f"{r['fp8_served_us']:.1f} | {r['w4a16_us']:.1f} | {r['w4a8_us']:.1f} | "
              f"{r['codes_us']:.1f} | {tflops:.0f} | "
              f"{r['fp8_served_us'] / r['w4a8_us']:.2f}x | {r['w4a16_us'] / r['w4a8_us']:.2f}x | "
              f"{r['w4a8_rel_err_vs_w4a16']:.4f} |")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
