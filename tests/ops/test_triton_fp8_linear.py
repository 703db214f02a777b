"""The FP8 weight matmuls against torch_ref.linear on the dequantized FP8 weight: the Triton
W8A16 kernel, and W8A8 (activations per token) as fp8_linear serves it (its kernels:
tests/ops/test_triton_fp8_w8a8.py)."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.fp8 import Fp8Weight, expand, quantize_fp8

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


def test_w8a8_emulated_where_fp8_matmul_cannot_run():
    """W8A8 weights quantize the activations per token at any number of tokens on every path:
    here fp32 activations (the W8A16 kernel after rounding x), against torch_ref's emulation."""
    run(20, 40, 384, None, torch.float32, seed=4, w8a8=True)
    run(17, 128, 256, 128, torch.float32, gated=True, residual=True, seed=5, w8a8=True)
    run(1, 40, 384, None, torch.float32, seed=6, w8a8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 17, 33, 64, 65, 200, 2048])
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 17, 64, 200])
def test_linear_w8a8_with_norm_gpu(dtype, m):
    """ops.triton.linear with an RMSNorm before a W8A8 weight (qkv, gate_up): the norm runs in the
    kernel that quantizes x; against torch_ref.linear on torch_ref.rms_norm's output in x's
    dtype (what is quantized: rounded to e4m3 from there, not from fp32)."""
    from frugal.ops.triton.linear import linear

    g = torch.Generator().manual_seed(m)
    for n, k, gated in ((1024, 4096, False), (512, 1536, True)):
        q = quantize_fp8(torch.randn(2 * n if gated else n, k, generator=g) * k ** -0.5,
                         w8a8=True)
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
        ref = torch_ref.linear(torch_ref.rms_norm(x, norm, 1e-5).float(), q, gated=gated)
        got = linear(x.cuda(), q.to("cuda"), norm=norm.cuda(), eps=1e-5, gated=gated)
        assert got.shape == (m, n) and got.dtype == dtype
        tol = {torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]  # (a norm an ulp apart can
        # move an e4m3 rounding)
        torch.testing.assert_close(got.float().cpu(), ref, atol=tol * ref.abs().max().item(),
                                   rtol=tol)
