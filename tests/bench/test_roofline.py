"""The roofline arithmetic of `frugal bench offline`, and the CUDA-graph batch ladder."""

import pytest

from frugal.bench.roofline import Device, ModelCost, bound
from frugal.worker.cuda_graph import capture_sizes


def test_bound_is_prefill_flops_plus_decode_bytes():
    cost = ModelCost(weight_bytes=16e9, kv_bytes_per_token=131072, flops_per_token=14e9,
                     lm_head_flops=1e9, attention_flops=0.0)
    device = Device(bandwidth=4e12, matmul_flops=700e12)
    b = bound(cost, device, concurrency=1, input_len=512, output_len=3)
    prefill = (512 * 14e9 + 1e9) / 700e12
    steps = [(16e9 + (512 + s) * 131072) / 4e12 for s in (1, 2)]
    assert b.output_tok_s == pytest.approx(3 / (prefill + sum(steps)))
    assert b.decode_step_ms == pytest.approx(1e3 * sum(steps) / 2)


def test_bound_takes_flops_when_a_decode_step_is_compute_bound():
    cost = ModelCost(weight_bytes=1e6, kv_bytes_per_token=0, flops_per_token=1e12,
                     lm_head_flops=0.0, attention_flops=0.0)
    b = bound(cost, Device(bandwidth=1e12, matmul_flops=1e12), concurrency=4, input_len=1,
              output_len=2)
    assert b.decode_step_ms == pytest.approx(4e3)  # 4 tokens x 1 TFLOP at 1 TFLOP/s


def test_graph_batch_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def test_closed_loop_bound_lets_decode_ride_on_prompt_compute():
    cost = ModelCost(weight_bytes=16e9, kv_bytes_per_token=131072, flops_per_token=14e9,
                     lm_head_flops=1e9, attention_flops=0.0)
    device = Device(bandwidth=4e12, matmul_flops=700e12)
    one = bound(cost, device, concurrency=8, input_len=4096, output_len=4)
    loop = bound(cost, device, concurrency=8, input_len=4096, output_len=4, rounds=3)
    flops = 8 * (4096 * 14e9 + 1e9) + 3 * 8 * (14e9 + 1e9)  # prompts, then 3 decode steps
    reads = 3 * 16e9 + sum(8 * (4096 + s) * 131072 for s in (1, 2, 3))
    assert loop.output_tok_s == pytest.approx(8 * 4 / max(flops / 700e12, reads / 4e12))
    assert loop.output_tok_s > one.output_tok_s  # the steps' weight reads hide under prompts
    assert loop.decode_step_ms == one.decode_step_ms
