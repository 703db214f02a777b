"""INT4 experts on the sorted path's wide K steps (ops.triton.moe_int4: the activations split
into nibble columns in registers, transposed products under 64 rows) against torch_ref."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.experts import quantize_experts
from tests.ops import launches

tri = pytest.importorskip("frugal.ops.triton.moe")
gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("block_n,block_k", [(32, 128), (64, 256)])
def test_sorted_int4_wide_steps(block_m, block_n, block_k, monkeypatch):
    """Blocks of 16 rows (the transposed product) and 64, K steps of 128 and 256 inputs over
    160 and 96 (the last step masked), output tiles past N (96 outputs, tiles of 64)."""
    from frugal.ops.triton import moe_configs

    g = torch.Generator().manual_seed(block_m + block_k)
    experts, top_k, hidden, inter, tokens = 6, 2, 160, 96, 37
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    gate_up, down = quantize_experts(gate_up, "int4"), quantize_experts(down, "int4")
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    entry = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2,
             "BLOCK_M": block_m}
    table = {moe_configs.key("sorted", 2, n, k, tokens * top_k): entry
             for n, k in ((inter, hidden), (hidden, inter))}
    monkeypatch.setattr(moe_configs, "device_name", lambda device: "a tuned GPU")
    monkeypatch.setattr(moe_configs, "_table", lambda: {"a tuned GPU": table})
    monkeypatch.setattr(gemv, "MAX_SLOTS", 0)  # the sorted path
    launched = launches.record(monkeypatch, tri, "_sorted_gemm", "BLOCK_M", "BLOCK_K")
    got = tri.fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)))
    assert launched == [(block_m, block_k)] * 2
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("block_k,prefetch", [(1024, 0), (2048, 1)])
def test_gemv_int4_k_steps_past_the_inputs(block_k, prefetch):
    """The small-batch GEMV with a whole row's words in one K step (tune_moe's widest INT4
    candidates: one load of every word in flight), K steps wider than both matrices' inputs
    (160 and 96), loaded ahead or not, against torch_ref."""
    g = torch.Generator().manual_seed(block_k)
    experts, top_k, hidden, inter, tokens = 4, 2, 160, 96, 3
    gate_up = quantize_experts(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, "int4")
    down = quantize_experts(torch.randn(experts, hidden, inter, generator=g) * 0.1, "int4")
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    x, gate_up, down, weights, ids = (t.to(DEVICE) for t in (x, gate_up, down, weights, ids))
    config = {"BLOCK_N": 8, "BLOCK_K": block_k, "num_warps": 4, "PREFETCH": prefetch}
    flat = ids.reshape(-1).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    gemv._launch(x, gate_up, act, inter, flat, None, top_k, config)
    out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    gemv._launch(act, down, out, hidden, flat, weights.reshape(-1).float().contiguous(), 1,
                 config)
    got = out.reshape(tokens, top_k, hidden).sum(1)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 16])
def test_sorted_int4_bf16_gpu(tokens, monkeypatch):
    """bf16 activations on the GPU (the interpreter multiplies in fp32): blocks of 16 rows, as
    FRUGAL_INT4_TRANS_BELOW and FRUGAL_INT4_BF16 set them (transposed on wgmma, dequantized in
    bf16 pairs), against torch_ref in fp32."""
    monkeypatch.setattr(gemv, "MAX_SLOTS", 0)  # the sorted path
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 16, 4, 512, 256
    gate_up = quantize_experts(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05, "int4")
    down = quantize_experts(torch.randn(experts, hidden, inter, generator=g) * 0.05, "int4")
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)
    ref = torch_ref.fused_moe(x.float(), gate_up, down, weights, ids)
    got = tri.fused_moe(x.cuda(), gate_up.to("cuda"), down.to("cuda"), weights.cuda(), ids.cuda())
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2 * ref.abs().max().item(),
                               rtol=2e-2)
