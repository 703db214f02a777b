"""The FP8 weight matmuls against torch_ref.linear on the dequantized FP8 weight: the Triton
W8A16 kernel, and W8A8 (activations per token, on _scaled_mm) with its row-quantizing kernel."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.fp8 import Fp8Weight, expand, quantize_fp8, quantize_rows

tri = pytest.importorskip("frugal.ops.triton.fp8_linear")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(m, n, k, block, dtype, gated=False, bias=False, residual=False, config=None, seed=0,
        w8a8=False):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    q = quantize_fp8(torch.randn(rows, k, generator=g) * k ** -0.5, block, w8a8)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(rows, generator=g).to(dtype) if bias else None
    r = torch.randn(m, n, generator=g).to(dtype) if residual else None
    ref = torch_ref.linear(x.float(), q, None if b is None else b.float(), gated=gated,
                           residual=None if r is None else r.float())
    got = tri.fp8_linear(x.to(DEVICE), q.to(DEVICE), None if b is None else b.to(DEVICE), gated,
                         None if r is None else r.to(DEVICE), config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    # fp16 products of bf16-rounded activations: a few bf16 ulps of the output's scale
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * ref.abs().max().item(),
                               rtol=tol)


def test_quantize_fp8_round_trip():
    """Per channel and per 128×128 block: within half of FP8's step (relative 1/16, or
    2^-10 · scale among the subnormals); the scale of a channel or tile maps its largest value
    to 448; an all-zero row is exact."""
    w = torch.randn(200, 300)
    w[7] = 0
    for block in (None, 128):
        q = quantize_fp8(w, block)
        err = (q.dequantize() - w).abs()
        assert bool((err <= w.abs() / 16 + expand(q.scales, block, 200, 300) / 1024).all())
        assert q.data.float().abs().max() == 448
        assert bool((q.dequantize()[7] == 0).all())
    with pytest.raises(ValueError, match="scales"):
        Fp8Weight(q.data, torch.ones(200, 1), 128)


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_linear_scales(block):
    run(3, 40, 384, block, torch.float32, seed=1)


@pytest.mark.parametrize("gated,bias,residual", [(True, False, False), (False, True, True),
                                                 (True, True, True)])
def test_fp8_linear_epilogues(gated, bias, residual):
    run(2, 128, 256, 128, torch.float32, gated, bias, residual)
    run(2, 24, 256, None, torch.float32, gated, bias, residual)


def test_fp8_linear_uneven_k_and_split():
    run(5, 24, 200, None, torch.float32, gated=True, residual=True, config=(16, 16, 2, 4, 2))
    run(1, 128, 384, 128, torch.float32, config=(16, 32, 3, 4, 2))


def test_quantize_rows_kernel():
    """The row-quantizing kernel against quant.fp8.quantize_rows: the same scales, the same codes
    on the GPU (the interpreter's fp32 -> e4m3 conversion halves values that round up to a power
    of two, so there they are compared loosely), zero rows (a zero input row and the padding up
    to 16 rows) all zeros."""
    x = torch.randn(5, 300, device=DEVICE) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5e3],
                                                         device=DEVICE)[:, None]
    q, scales = tri.quantize_rows_padded(x)
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


def test_w8a8_emulated_where_fp8_matmul_cannot_run():
    """W8A8 weights quantize the activations per token in steps of more than 16 tokens on every
    path: here fp32 activations (the W8A16 kernel after rounding x), against torch_ref's
    emulation; up to 16 tokens they are kept (W8A16)."""
    run(20, 40, 384, None, torch.float32, seed=4, w8a8=True)
    run(17, 128, 256, 128, torch.float32, gated=True, residual=True, seed=5, w8a8=True)
    run(16, 40, 384, None, torch.float32, seed=6, w8a8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 64, 200, 2048])
def test_fp8_linear_w8a8_gpu(dtype, m):
    run(m, 1024, 4096, None, dtype, seed=m, w8a8=True)
    run(m, 512, 1536, None, dtype, gated=True, residual=True, seed=m + 1, w8a8=True)
    run(m, 576, 576, None, dtype, bias=True, seed=m + 2, w8a8=True)
    run(m, 40, 96, None, dtype, seed=m + 3, w8a8=True)  # N not a multiple of 16: emulated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 64, 200])
def test_fp8_linear_gpu(dtype, m):
    run(m, 1024, 4096, None, dtype, seed=m)
    run(m, 512, 1536, 128, dtype, gated=True, residual=True, seed=m + 1)
    run(m, 576, 576, None, dtype, bias=True, seed=m + 2)
