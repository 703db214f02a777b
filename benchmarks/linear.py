"""Micro-benchmark: a decode layer's matmuls with their neighbours, frugal vs cuBLAS, on one GPU.

For each matmul of a Llama-3.1-8B layer (--model qwen3: Qwen3-30B-A3B's attention projections,
narrower) and the lm_head at a decode batch of --tokens rows, times frugal's `ops.triton.linear`
(at one token the fused GEMV, at 2..64 the fused tensor-core kernel where it is used: RMSNorm,
bias, SiLU·mul and residual add inside) against the unfused sequence (cuBLAS F.linear plus the
Triton RMSNorm / SiLU·mul kernels and the add), and cuBLAS's matmul alone, and prints the
weight-read bandwidth.
   python benchmarks/linear.py [--tokens 64] [--sweep]
   python benchmarks/linear.py --model qwen3 --tokens 64 --sweep --sites qkv,o

Times are medians of CUDA-graph replays; each call reads its own copy of the weight (as the
layers of a model do), so nothing is served from L2. --sweep also times every config of the
fused kernel for that many tokens.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from timing import graph_time

from frugal.ops.triton import elementwise
from frugal.ops.triton.linear import gemv, linear, small_m_linear

# name: (out features, in features, norm before, gated, residual after); Llama-3.1-8B
SITES = {"qkv": (6144, 4096, True, False, False), "o": (4096, 4096, False, False, True),
         "gate_up": (14336, 4096, True, True, False), "down": (4096, 14336, False, False, True),
         "lm_head": (128256, 4096, False, False, False)}
QWEN3_SITES = {"qkv": (5120, 2048, True, False, False), "o": (2048, 4096, False, False, True),
               "lm_head": (151936, 2048, False, False, False)}
CONFIGS = list(itertools.product((2, 4, 8, 16), (128, 256, 512, 1024), (4, 8), (1,), (1, 2, 4, 8)))
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core kernel
SMALL_M_CONFIGS = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5))
                   if c[0] * c[1] * c[3] <= 64 * 128 * 5]
# ... and split over K (SPLIT_K programs a block of outputs), for matrices of few output blocks
SMALL_M_CONFIGS += [(*c, split) for c in [(32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4),
                                          (128, 128, 8, 3)] for split in (2, 4, 8)]


def sweep_configs(m: int) -> list:
    if m == 1:
        return [c for c in CONFIGS if c[0] * c[1] * c[4] <= 32768 and c[1] * c[4] <= 4096]
    return SMALL_M_CONFIGS


def bench(name: str, m: int, sweep: bool, sites: dict = SITES) -> dict:
    n, k, norm, gated, res = sites[name]
    dev, dt = "cuda", torch.bfloat16
    rows = 2 * n if gated else n
    copies = 2 if name == "lm_head" else 16
    weights = [torch.randn(rows, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=dt)
    g = torch.rand(k, device=dev, dtype=dt) + 0.5 if norm else None
    r = torch.randn(m, n, device=dev, dtype=dt) if res else None
    fused_kernel = gemv if m == 1 else small_m_linear

    def unfused(w):
        h = elementwise.rms_norm(x, g, 1e-5) if norm else x
        y = F.linear(h, w)
        y = elementwise.silu_and_mul(y) if gated else y
        return y + r if res else y

    def time(fn) -> float:
        return graph_time([lambda w=w: fn(w) for w in weights])

    out = {"site": name, "bytes": rows * k * 2,
           "cublas_ms": time(lambda w: F.linear(x, w)), "unfused_ms": time(unfused),
           "fused_ms": time(lambda w: linear(x, w, None, g, 1e-5, gated, r))}
    if sweep:
        results = []
        for cfg in sweep_configs(m):
            try:
                ms = time(lambda w, c=cfg: fused_kernel(x, w, None, g, 1e-5, gated, r, c))
            except Exception as e:  # a config out of shared memory or registers
                print(f"  {name} {cfg}: {type(e).__name__}")
                continue
            results.append((ms, cfg))
        results.sort()
        out["best"] = results[:5]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=1, help="rows of x (a decode batch)")
    p.add_argument("--sweep", action="store_true", help="time every fused-kernel config too")
    p.add_argument("--sites", default=None, help="comma-separated (default: all)")
    p.add_argument("--model", choices=["llama", "qwen3"], default="llama")
    a = p.parse_args()
    sites = QWEN3_SITES if a.model == "qwen3" else SITES
    shape = "Qwen3-30B-A3B" if a.model == "qwen3" else "Llama-3.1-8B"
    print(f"{torch.cuda.get_device_name()} | {shape} matmuls at {a.tokens} tokens, bf16 | "
          f"CUDA-graph replay medians\n")
    print("| matmul | weight MB | frugal fused µs | TB/s | cuBLAS + separate ops µs | "
          "cuBLAS matmul alone µs | TB/s | fused vs unfused |")
    print("|---|---|---|---|---|---|---|---|")
    for name in (a.sites or ",".join(sites)).split(","):
        r = bench(name, a.tokens, a.sweep, sites)
        tbs = r["bytes"] / r["fused_ms"] / 1e9
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {r['fused_ms'] * 1e3:.1f} | {tbs:.2f} | "
              f"{r['unfused_ms'] * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} | "
              f"{r['bytes'] / r['cublas_ms'] / 1e9:.2f} | "
              f"{r['unfused_ms'] / r['fused_ms']:.2f}x |", flush=True)
        for ms, cfg in r.get("best", []):
            print(f"  {name} config {cfg}: {ms * 1e3:.1f} µs "
                  f"{r['bytes'] / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
