"""The roofline of a fixed-concurrency workload: the fastest any engine could run it here.

Prefill is bound by matmul FLOPs at the measured matmul rate, each decode step by the bytes it
must read (the weights once, plus every request's cached K/V) at the measured memory bandwidth
(or by its FLOPs, if those take longer). Both rates are measured on the device at the start of
the run, as `../shared/tools/gpu_peers.py bw` measures them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from frugal.engine.llm_engine import LLMEngine


@dataclass
class Device:
    """Measured ceilings: bandwidth of a device-to-device copy, dense matmul rate."""

    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s in the model's dtype


@dataclass
class ModelCost:
    """Per-token costs of a model, from its parameters and KV pool."""

    weight_bytes: int  # read by every step (the embedding table is gathered, not read)
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: float  # 2 x matmul parameters (lm_head excluded)
    lm_head_flops: float  # 2 x vocab x hidden, for each sampled row
    attention_flops: float  # per (query, key) pair over all layers: 4 x heads x head_dim

    @classmethod
    def of(cls, engine: LLMEngine) -> ModelCost:
        mc, runner = engine.model_config, engine.runner
        model, pool = runner.model, runner.pool
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight
        lm_head = model.lm_head.weight
        embed_bytes = 0 if mc.tie_word_embeddings else embed.numel() * embed.element_size()
        matmul_params = sum(p.numel() for n, p in model.named_parameters()
                            if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
        for module in model.modules():  # quantized matmuls keep their weights outside params
            q = getattr(module, "qweight", None)
            if q is not None:
                total += sum(t.numel() * t.element_size() for t in vars(q).values()
                             if isinstance(t, torch.Tensor))
                matmul_params += module.in_features * module.out_features
        return cls(weight_bytes=total - embed_bytes,
                   kv_bytes_per_token=pool.num_bytes // pool.capacity_tokens,
                   flops_per_token=2.0 * matmul_params,
                   lm_head_flops=2.0 * lm_head.numel(),
                   attention_flops=4.0 * mc.num_layers * mc.num_heads * mc.head_dim)


def _timed(fn, device: str, repeats: int = 10) -> float:
    """Median seconds of fn() on `device`."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_device(device: str, dtype: torch.dtype) -> Device:
    """Copy 1 GiB (GPU) / 256 MiB (CPU) device to device; multiply two n x n matrices."""
    size, n = (2**30, 8192) if device.startswith("cuda") else (2**28, 1024)
    x = torch.empty(size // 2, dtype=torch.float16, device=device).fill_(1.0)
    y = torch.empty_like(x)
    copy = _timed(lambda: y.copy_(x), device)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    mm = _timed(lambda: a @ b, device)
    return Device(bandwidth=2 * size / copy, matmul_flops=2 * n**3 / mm)


@dataclass
class Bound:
    output_tok_s: float  # all output tokens / (prefill + decode) at the roofline
    decode_step_ms: float  # mean decode step (= inter-token latency) at the roofline


def bound(cost: ModelCost, device: Device, concurrency: int, input_len: int,
          output_len: int, rounds: int = 1) -> Bound:
    """Roofline of `concurrency` prompts of input_len tokens each generating output_len.

    One round: the prompts' compute, then output_len - 1 decode steps, each reading the weights
    and every request's KV. rounds > 1 (a closed loop, `concurrency` in flight): decode steps
    may ride on prompt chunks, so only the totals bind: time >= max(all FLOPs / matmul rate,
    bytes / bandwidth), with the weights read once per step of each round's output_len - 1."""
    c = concurrency
    prefill_flops = c * (input_len * cost.flops_per_token + cost.lm_head_flops
                         + cost.attention_flops * input_len * (input_len + 1) / 2)
    prefill = prefill_flops / device.matmul_flops
    decode = decode_flops = decode_kv = 0.0
    for step in range(1, output_len):
        context = input_len + step
        read = cost.weight_bytes + c * context * cost.kv_bytes_per_token
        flops = c * (cost.flops_per_token + cost.lm_head_flops + cost.attention_flops * context)
        decode += max(read / device.bandwidth, flops / device.matmul_flops)
        decode_flops += flops
        decode_kv += c * context * cost.kv_bytes_per_token
    steps = max(output_len - 1, 1)
    if rounds > 1:
        reads = (output_len - 1) * cost.weight_bytes + decode_kv
        wave = max((prefill_flops + decode_flops) / device.matmul_flops,
                   reads / device.bandwidth)
    else:
        wave = prefill + decode
    return Bound(output_tok_s=c * output_len / wave, decode_step_ms=1e3 * decode / steps)
