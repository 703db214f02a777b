"""The W4A8 prefill kernel (INT4 weights, x in e4m3 per row and 128-input tile) against
torch_ref.linear on round_tiles(x) and the dequantized weight."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.fp8 import FP8, round_tiles
from frugal.quant.int4 import Int4Weight, quantize_rtn

tri = pytest.importorskip("frugal.ops.triton.int4_prefill")
int4 = pytest.importorskip("frugal.ops.triton.int4_linear")
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def weight(rows, k, group, form, g):
    w = torch.randn(rows, k, generator=g) * k ** -0.5
    if form == "mins":  # GGUF Q4_1: w = u · scale + min, min no multiple of scale
        q = quantize_rtn(w, group, symmetric=False)
        mins = -q.zeros * q.scales + torch.rand(q.scales.shape, generator=g) * q.scales
        return Int4Weight(q.packed, q.scales, mins=mins)
    return quantize_rtn(w, group, symmetric=form == "sym")


def quantize_ref(x):
    """quantize_tiles in torch: (codes [M, Kp], scales [M, Kp / 128], sums [M, Kp / 128])."""
    m, k = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -k % 128)).reshape(m, -1, 128)
    scales = xp.abs().amax(-1).clamp(min=1e-12) / 448
    q = (xp / scales[..., None]).to(FP8)
    return q.reshape(m, -1), scales, q.float().sum(-1) * scales


def test_quantize_tiles_matches_torch():
    """One scale per row and tile and each tile's sum, as quantize_ref; on the GPU the same
    codes (the interpreter's fp32 -> e4m3 conversion halves values that round up to a power of
    two, so there they are compared loosely); a zero row and the padding all zeros."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 200, generator=g) * 30
    x[3] = 0.0
    q, scales, sums = tri.quantize_tiles(x.to(DEVICE))
    want_q, want_scales, want_sums = quantize_ref(x)
    assert q.shape == (32, 256) and q.dtype == FP8 and scales.shape == sums.shape == (32, 2)
    assert scales.stride() == (1, 32)  # (tile-major, as cuBLAS's block scales)
    assert bool(q[19:].float().eq(0).all()) and bool(sums[19:].eq(0).all())
    q, scales, sums = q[:19], scales[:19], sums[:19]
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-6, atol=0)
    got, want = q.float().cpu(), want_q.float()
    assert bool(((got - want).abs() <= want.abs() / 2 + 2 ** -9).all())
    assert bool(got[3].eq(0).all()) and bool(got[:, 200:].eq(0).all())
    if GPU:
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
        torch.testing.assert_close(sums.cpu(), want_sums, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(sums, (got.view(19, 2, 128).sum(-1) * scales), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("k", [256, 160])
def test_codes_are_the_weights_codes_minus_8(k):
    q = quantize_rtn(torch.randn(70, k), 32, symmetric=False)
    got = tri.codes(int4.repack(q.to(DEVICE), torch.float32).words.to(DEVICE)).cpu()
    assert got.shape == (70, 256) and got.dtype == FP8
    assert torch.equal(got.float()[:, :k], q.codes().float() - 8)
    assert bool(got.float()[:, k:].eq(-8).all())  # (padding codes 0; x's padding is 0)


def run(m, n, k, group, form, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = weight(n, k, group, form, g)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    tiles = int4.repack(w.to("cuda"), dtype)
    assert tiles.centered == (form == "sym")
    got = tri.w4a8_matmul(x.cuda(), tiles.words, tiles.params, group, tiles.centered)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = torch_ref.linear(round_tiles(x.float()), w.dequantize())
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * ref.abs().max().item(),
                               rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [65, 200, 1000])
@pytest.mark.parametrize("group,form,k", [(128, "sym", 1024), (128, "asym", 1000),
                                          (128, "mins", 1024), (256, "sym", 2048),
                                          (256, "mins", 1024)])
def test_w4a8_gpu(dtype, m, group, form, k):
    run(m, 384, k, group, form, dtype, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("gated,bias,residual", [(True, False, False), (False, True, True)])
def test_int4_linear_runs_w4a8_beyond_64_rows(gated, bias, residual):
    g = torch.Generator().manual_seed(3)
    n, k, m = 256, 640, 300
    rows = 2 * n if gated else n
    w = weight(rows, k, 64, "asym", g)
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(rows, generator=g).bfloat16() if bias else None
    r = torch.randn(m, n, generator=g).bfloat16() if residual else None
    ref = torch_ref.linear(round_tiles(x.float()), w.dequantize(),
                           None if b is None else b.float(), gated=gated,
                           residual=None if r is None else r.float())
    tiles = int4.repack(w.to("cuda"), torch.bfloat16)
    xc = x.cuda()
    assert int4.rounds_activations(xc, tiles)
    got = int4.int4_linear(xc, tiles, None if b is None else b.cuda(), gated,
                           None if r is None else r.cuda()).float().cpu()
    torch.testing.assert_close(got, ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
