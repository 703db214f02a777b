"""W8A8 FP8 experts (quant.experts.Fp8Experts.w8a8): activations rounded to e4m3 per row and 128
inputs in registers (ops.triton.fp8_groups), on the small-batch and the sorted path, against
torch_ref.fused_moe, which rounds them with quant.fp8.quantize_groups."""

import pytest
import torch
import triton
import triton.language as tl

from frugal.ops import torch_ref
from frugal.quant.experts import Fp8Experts, quantize_experts, stack
from frugal.quant.fp8 import quantize_fp8, quantize_groups

tri = pytest.importorskip("frugal.ops.triton.moe")
gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
groups = pytest.importorskip("frugal.ops.triton.fp8_groups")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _quantize(x_ptr, q_ptr, s_ptr, ROWS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * 128 + tl.arange(0, 128)[None, :]
    q, s = groups.quantize_group(tl.load(x_ptr + offs))
    tl.store(q_ptr + offs, q)
    tl.store(s_ptr + tl.arange(0, ROWS), s)


def test_groups_round_as_torch_casts():
    """quantize_group's codes and scales equal quantize_groups' bit for bit, ties to even and
    e4m3's subnormals included (rows of 1e-3 to 1e3, an all-zero row)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g) * torch.logspace(-3, 3, 8)[:, None]
    x[0, :6] = torch.tensor([1.0625, 1.1875, -3e-5, 1e-7, 0.0, 448.0])  # (scale 1: ties)
    x[1] = 0.0
    x[2, :4] = torch.tensor([448.0, 2**-9 * 1.5, 2**-10, 2**-10 * 3])  # (subnormal ties)
    q, s = torch.empty(8, 128, device=DEVICE), torch.empty(8, device=DEVICE)
    _quantize[(1,)](x.to(DEVICE), q, s, ROWS=8)
    want_q, want_s = quantize_groups(x)
    assert torch.equal(q.cpu(), want_q.float()) and torch.equal(s.cpu(), want_s[:, 0])


def experts(block, g, inter=128, hidden=320, count=6):
    """(gate_up, down) as W8A8 FP8 experts: 128 × 128 blocks, or per channel (block None)."""
    def fp8(w):
        return stack([quantize_fp8(e, block, w8a8=True) for e in w])
    return (fp8(torch.randn(count, 2 * inter, hidden, generator=g) * hidden ** -0.5),
            fp8(torch.randn(count, hidden, inter, generator=g) * inter ** -0.5))


@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("tokens,sorted_path", [(3, False), (3, True), (40, True), (60, True)])
def test_w8a8_experts_match_torch_ref(block, tokens, sorted_path, monkeypatch):
    """Both paths (hidden 320: a last group of 64 inputs; the sorted one's blocks of 16 rows
    rounding their inputs, of 64 taking them rounded once by fp8_groups.quantize), against
    torch_ref's rounding; the result differs from the same experts multiplied without rounding
    their inputs (by 3-5 %: the tolerance leaves room for an intermediate activation an ulp
    apart, which moves its group's scale and so its rounding)."""
    g = torch.Generator().manual_seed(tokens + (block or 0))
    gate_up, down = experts(block, g)
    assert gate_up.w8a8 and down.w8a8
    x = torch.randn(tokens, 320, generator=g)
    weights, ids = torch.rand(tokens, 6, generator=g).topk(2, dim=-1)
    if sorted_path:
        monkeypatch.setattr(gemv, "MAX_SLOTS", 0)
    assert tri.rows_per_block(tokens * 2, 6) == (64 if tokens == 60 else 16)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    got = tri.fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids))).cpu()
    torch.testing.assert_close(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=2e-3)
    plain = torch_ref.fused_moe(x, Fp8Experts(gate_up.data, gate_up.scales, block),
                                Fp8Experts(down.data, down.scales, block), weights, ids)
    assert (plain - ref).abs().max() > 1e-2 * ref.abs().max()  # (the rounding shows)


@pytest.mark.parametrize("tokens,sorted_path", [(3, False), (3, True), (60, True)])
def test_a_nan_input_stays_nan(tokens, sorted_path, monkeypatch):
    """A token whose activations hold a NaN gets NaN (as W8A16 and torch_ref give), not the
    finite value a max or clamp that drops NaN would round it to; the others are finite."""
    g = torch.Generator().manual_seed(9)
    gate_up, down = experts(128, g)
    x = torch.randn(tokens, 320, generator=g)
    x[1, 5] = float("nan")
    weights, ids = torch.rand(tokens, 6, generator=g).topk(2, dim=-1)
    if sorted_path:
        monkeypatch.setattr(gemv, "MAX_SLOTS", 0)
    got = tri.fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids))).cpu()
    assert bool(got[1].isnan().all())
    assert bool(got[torch.arange(tokens) != 1].isfinite().all())


def test_w8a8_flag_travels_and_needs_groups_of_128():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 256, 256, generator=g)
    assert quantize_experts(w, "fp8", w8a8=True).w8a8
    assert not quantize_experts(w, "fp8").w8a8
    assert quantize_experts(w, "fp8", w8a8=True).to("cpu").w8a8
    with pytest.raises(ValueError, match="differ in scaling"):
        stack([quantize_fp8(w[0], 128, w8a8=True), quantize_fp8(w[1], 128)])
    with pytest.raises(ValueError, match="multiple of 128"):
        stack([quantize_fp8(e, 16, w8a8=True) for e in w])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_as_quantize_groups(dtype):
    """fp8_groups.quantize (rows past a program's 16, a last group of 40 inputs) stores
    quantize_groups' codes and scales."""
    x = (torch.randn(37, 296, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    q, s = groups.quantize(x.to(DEVICE))
    want_q, want_s = quantize_groups(x)
    assert q.dtype == want_q.dtype and torch.equal(q.cpu().float(), want_q.float())
    assert torch.equal(s.cpu(), want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("tokens", [1, 16, 600])
def test_w8a8_bf16_gpu(block, tokens):
    """bf16 activations on the GPU's FP8 tensor cores (600 tokens: blocks of 64 rows, their
    inputs rounded once), against torch_ref in fp32 rounding the same way."""
    g = torch.Generator().manual_seed(tokens)
    gate_up, down = experts(block, g, inter=256, hidden=512, count=32)
    x = torch.randn(tokens, 512, generator=g).bfloat16()
    weights, ids = torch.rand(tokens, 32, generator=g).topk(4, dim=-1)
    ref = torch_ref.fused_moe(x.float(), gate_up, down, weights, ids)
    got = tri.fused_moe(*(t.to("cuda") for t in (x, gate_up, down, weights, ids)))
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2 * ref.abs().max().item(),
                               rtol=3e-2)
