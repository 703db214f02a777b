"""fp8_w8a8's kernels: the row-quantizing kernel against quant.fp8.quantize_rows, and the
split-K FP8 matmul against torch_ref.linear on x rounded per token (quant.fp8.round_rows) and
the dequantized weight; in the CPU interpreter the e4m3 values multiply in fp32, exactly.
(fp8_linear's W8A8 path end to end: tests/ops/test_triton_fp8_linear.py.)"""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.fp8 import Fp8Weight, quantize_fp8, quantize_rows

w8a8 = pytest.importorskip("frugal.ops.triton.fp8_w8a8")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(m, n, k, dtype, gated=False, bias=False, residual=False, config=None, seed=0):
    """multiply() on x's codes made by torch against the reference on the same values."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    w = quantize_fp8(torch.randn(rows, k, generator=g) * k ** -0.5, w8a8=True)
    x = torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4
    b = torch.randn(rows, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if residual else None
    q, scales = quantize_rows(x)
    ref = torch_ref.linear(q.float() * scales, Fp8Weight(w.data, w.scales), b, gated=gated,
                           residual=r)  # (x as rounded; the weight's copy without w8a8)
    dev = [None if t is None else t.to(DEVICE).to(dtype) for t in (b, r)]
    got = w8a8.multiply(q.to(DEVICE), scales.to(DEVICE), m, w.to(DEVICE), dtype, dev[0], gated,
                        dev[1], config)
    assert got.shape == (m, n) and got.dtype == dtype
    # the same products; sums in another order (on the GPU by FP8 MMAs, which add with fewer
    # bits than fp32: about 14 on Hopper), the output rounded to dtype
    tol = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-3, torch.bfloat16: 1e-2,
           torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * ref.abs().max().item(),
                               rtol=tol)


def test_w8a8_kernel():
    """Plain matmuls: a few rows, and 16 rows of a partial last tile."""
    run(3, 40, 384, torch.float32, seed=1)
    run(16, 64, 200, torch.float32, bias=True, seed=2)  # a partial tile


@pytest.mark.parametrize("gated,bias,residual", [(True, False, False), (False, True, True),
                                                 (True, True, True)])
def test_w8a8_kernel_epilogues(gated, bias, residual):
    run(2, 128, 256, torch.float32, gated, bias, residual, seed=3)
    run(20, 24, 512, torch.float32, gated, bias, residual, config=(16, 2, 4, 2), seed=4)


def test_w8a8_kernel_rejects():
    """More rows than one block, or block-scaled weights, are not this kernel's."""
    w = quantize_fp8(torch.randn(64, 128), w8a8=True)
    q, s = quantize_rows(torch.randn(65, 128))
    with pytest.raises(ValueError, match="65 rows"):
        w8a8.multiply(q, s, 65, w, torch.float32)
    with pytest.raises(ValueError, match="4 rows"):
        w8a8.multiply(q[:3], s[:3], 4, w, torch.float32)  # (fewer codes than rows)
    with pytest.raises(ValueError, match="block 128"):
        w8a8.multiply(q, s, 4, quantize_fp8(torch.randn(128, 128), 128, True), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 4])
def test_w8a8_kernel_sums_in_fp32_gpu(split):
    """Products of one sign over K = 14336 (where FP8 MMAs, adding with about 14 bits, drift):
    within bf16's rounding of an fp64 sum of the same FP8 values, whatever the split."""
    g = torch.Generator().manual_seed(11)
    w = quantize_fp8(torch.rand(256, 14336, generator=g), w8a8=True)
    q, scales = quantize_rows(torch.rand(32, 14336, generator=g))
    ref = (q.double() * scales.double()) @ (w.data.double() * w.scales.double()).t()
    got = w8a8.multiply(q.cuda(), scales.cuda(), 32, w.to("cuda"), torch.bfloat16,
                        config=(64, split, 4, 4)).double().cpu()
    assert float((got - ref).norm() / ref.norm()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8, 17, 64])
def test_w8a8_kernel_gpu(dtype, m):
    run(m, 1024, 4096, dtype, seed=m)
    run(m, 512, 1536, dtype, gated=True, residual=True, seed=m + 1)
    run(m, 576, 576, dtype, bias=True, seed=m + 2)
    run(m, 40, 96, dtype, seed=m + 3)


def test_quantize_rows_kernel():
    """The row-quantizing kernel against quant.fp8.quantize_rows: the same scales, the same codes
    on the GPU (the interpreter's fp32 -> e4m3 conversion halves values that round up to a power
    of two, so there they are compared loosely), zero rows (a zero input row and the padding up
    to 16 rows) all zeros."""
    x = torch.randn(5, 300, device=DEVICE) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5e3],
                                                         device=DEVICE)[:, None]
    q, scales = w8a8.quantize_rows_padded(x)
    want_q, want_scales = quantize_rows(x)
    assert q.shape == (16, 300) and q.dtype == torch.float8_e4m3fn and scales.shape == (16, 1)
    torch.testing.assert_close(scales[:5], want_scales, rtol=0, atol=0)
    got, want = q[:5].float(), want_q.float()
    if DEVICE == "cuda":
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool(((got - want).abs() <= want.abs() / 2 + 2 ** -9).all())
    assert bool((q[3].float() == 0).all()) and bool((q[5:].float() == 0).all())
    assert bool(want_q.float().abs().amax(1)[[0, 1, 2, 4]].eq(448).all())
    if DEVICE == "cuda":  # the GPU's conversion is exact
        assert torch.equal(q[:5].view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_with_norm(dtype):
    """With a norm, the quantizing kernel gives the codes and scales of elementwise.rms_norm and
    then the plain quantizing kernel, exactly; against quantize_rows of torch_ref.rms_norm,
    scales within the norm's rounding (an ulp of x's dtype at the row's largest value) and
    codes within half their value (the interpreter's e4m3 conversion)."""
    from frugal.ops.triton.elementwise import rms_norm

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 576, generator=g) * torch.tensor([1e-2, 1.0, 40.0])[:, None]).to(dtype)
    norm = (torch.rand(576, generator=g) + 0.5).to(dtype)
    x, dnorm = x.to(DEVICE), norm.to(DEVICE)
    q, scales = w8a8.quantize_rows_padded(x, dnorm, 1e-6)
    two_q, two_scales = w8a8.quantize_rows_padded(rms_norm(x, dnorm, 1e-6))
    assert q.shape == (16, 576) and scales.shape == (16, 1)
    assert torch.equal(scales, two_scales)
    assert torch.equal(q.view(torch.uint8), two_q.view(torch.uint8))
    assert bool((q[3:].float() == 0).all())
    want_q, want_scales = quantize_rows(torch_ref.rms_norm(x.cpu(), norm, 1e-6).float())
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(scales[:3].cpu(), want_scales, rtol=2 * ulp, atol=0)
    got, want = q[:3].float().cpu(), want_q.float()
    assert bool(((got - want).abs() <= want.abs() / 2 + 2 ** -9).all())
