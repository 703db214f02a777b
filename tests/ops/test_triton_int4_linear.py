"""The Triton W4A16 matmul against torch_ref.linear on the dequantized weight."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.int4 import Int4Weight, quantize_rtn

tri = pytest.importorskip("frugal.ops.triton.int4_linear")
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def weight(rows, k, group, form, g):
    w = torch.randn(rows, k, generator=g) * k ** -0.5
    if form == "mins":  # GGUF Q4_1: w = u · scale + min, min no multiple of scale
        q = quantize_rtn(w, group, symmetric=False)
        mins = -q.zeros * q.scales + torch.rand(q.scales.shape, generator=g) * q.scales
        return Int4Weight(q.packed, q.scales, mins=mins)
    return quantize_rtn(w, group, symmetric=form == "sym")


def run(m, n, k, group, form, dtype, gated=False, bias=False, residual=False, config=None,
        seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    q = weight(rows, k, group, form, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(rows, generator=g).to(dtype) if bias else None
    r = torch.randn(m, n, generator=g).to(dtype) if residual else None
    ref = torch_ref.linear(x.float(), q.dequantize(), None if b is None else b.float(),
                           gated=gated, residual=None if r is None else r.float())
    tiles = tri.repack(q.to(DEVICE), dtype)
    assert tiles.centered == (form == "sym" and rows % 32 == 0)
    got = tri.int4_linear(x.to(DEVICE), tiles, None if b is None else b.to(DEVICE), gated,
                          None if r is None else r.to(DEVICE), config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * ref.abs().max().item(),
                               rtol=tol)


def test_repack_layout():
    """Rows in blocks of 64 (the last padded with zeros), each block's tiles one after another;
    word 4 t + q of a row's tile holds input 32 q + 16 a + 8 b + 2 t + c in nibble 2 a + b +
    4 c; scales and mins group-major."""
    q = quantize_rtn(torch.randn(67, 256), 64, symmetric=False)
    t = tri.repack(q, torch.float32)
    assert t.words.shape == (2, 2, 64, 16) and t.shape == (67, 256)  # block, tile, row, word
    assert not t.words[1, :, 3:].any()
    words = t.words.transpose(1, 2).reshape(128, 2, 4, 4)[:67]  # row, tile, t, q
    codes = q.codes().view(67, 2, 4, 2, 2, 4, 2)  # row, tile, q, a, b, t, c
    for a in range(2):
        for b in range(2):
            for c in range(2):
                nibble = (words >> (4 * (2 * a + b + 4 * c))) & 0xF
                assert torch.equal(nibble, codes[:, :, :, a, b, :, c].transpose(2, 3).int())
    assert torch.equal(t.params[..., 0], q.scales.t())  # [group, row, (scale, min)]
    assert torch.equal(t.params[..., 1], (-q.zeros * q.scales).t())
    assert not t.centered  # (zero points other than 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["sym", "asym", "mins"])
def test_repack_marks_symmetric_codes_centered(form, dtype):
    """centered (the kernel then multiplies code - 8 and skips Σ x, and the scales alone are
    kept): every min is -8 · scale and the rows a multiple of 32; one group off makes a weight
    not centered."""
    q = weight(32, 256, 64, form, torch.Generator().manual_seed(0))
    t = tri.repack(q, dtype)
    assert t.centered == (form == "sym")
    if form == "sym":  # (the scales alone, [group, row]; uncentered writes the mins out)
        assert torch.equal(t.params, q.scales.t().to(dtype))
        assert tri.kernel_params(t).dtype == torch.int16
        pairs = tri.uncentered(t).params
        assert torch.equal(pairs[..., 0], t.params) and torch.equal(pairs[..., 1], -8 * t.params)
        # (rows not a multiple of 32: the kernel could not copy two scales at once)
        assert not tri.repack(weight(48, 256, 64, form, torch.Generator()), dtype).centered
    else:
        assert t.params.shape == (4, 32, 2) and tri.kernel_params(t).dtype == torch.int32
    if form == "sym":
        mins = -q.zeros * q.scales
        mins[3, 2] += q.scales[3, 2]  # (zero point 7 in one group)
        assert not tri.repack(Int4Weight(q.packed, q.scales, mins=mins), dtype).centered


@pytest.mark.parametrize("group,form,k", [(32, "sym", 160), (64, "asym", 256), (128, "mins", 384),
                                          (256, "sym", 512)])
def test_dequantize_kernel(group, form, k):
    """The Triton dequantization (prefill's path, and every path off the GPU) reads the layout
    back to exactly Int4Weight.dequantize, padding cut off."""
    q = weight(40, k, group, form, torch.Generator().manual_seed(k))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = tri.dequantize(tri.repack(q.to(DEVICE), dtype), torch.float32)
        mins = q.mins if q.mins is not None else -q.zeros * q.scales
        half = Int4Weight(q.packed, q.scales.to(dtype).float(), mins=mins.to(dtype).float())
        torch.testing.assert_close(got.cpu(), half.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group,form", [(32, "sym"), (64, "asym"), (128, "mins"), (256, "sym")])
def test_int4_linear_groups_and_forms(group, form):
    run(3, 20, 256, group, form, torch.float32, seed=group)


@pytest.mark.parametrize("gated,bias,residual", [(True, False, False), (False, True, True),
                                                 (True, True, True)])
def test_int4_linear_epilogues(gated, bias, residual):
    run(2, 16, 128, 32, "asym", torch.float32, gated, bias, residual)


def test_int4_linear_rejects_wrong_inputs():
    q = quantize_rtn(torch.randn(16, 128), 32, symmetric=True)
    with pytest.raises(ValueError, match="inputs"):
        tri.int4_linear(torch.randn(1, 64, device=DEVICE), tri.repack(q.to(DEVICE), torch.float32))
    if GPU:
        tiles = tri.repack(q.to("cuda"), torch.bfloat16)
        with pytest.raises(ValueError, match="warpgroups"):
            tri.int4_linear(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16), tiles,
                            config=(32, 1, 4, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8, 16, 24, 33, 64, 200])
def test_int4_linear_gpu(dtype, m):
    """The tensor-core kernel (up to 64 rows; 200 rows dequantize) with its real configs, at
    real shapes: groups of 32 to 256, K padded (576), every epilogue; symmetric weights (code -
    8, no Σ x) plain, wide (blocks of 128 beyond 16 rows) and gated (split-K); zero points and
    mins (Σ x with ones)."""
    run(m, 1024, 4096, 128, "sym", dtype, seed=m)
    run(m, 8192, 1024, 128, "sym", dtype, seed=m + 5)
    run(m, 384, 576, 32, "sym", dtype, gated=True, residual=True, seed=m + 4)
    run(m, 512, 4096, 128, "sym", dtype, gated=True, bias=True, seed=m + 6)
    run(m, 512, 576, 32, "mins", dtype, gated=True, residual=True, seed=m + 1)
    run(m, 768, 1536, 64, "asym", dtype, bias=True, seed=m + 2)
    run(m, 320, 1024, 256, "mins", dtype, gated=True, seed=m + 3)  # groups over two tiles


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(64, 1, 4, 2), (128, 3, 4, 3), (64, 16, 4, 6), (128, 2, 8, 4),
                                    (256, 8, 4, 3), (64, 4, 4, 4)])
def test_int4_linear_gpu_configs(config):
    """Blocks of 64 to 256 outputs, one to 16 splits (the last split shorter: 5 tiles in 3),
    one or two warpgroups, 2 to 6 stages (more stages than a split has tiles); 200 gated
    outputs: the up half's rows start inside a block of 64 words' rows."""
    run(4, 200, 640, 32, "sym", torch.bfloat16, gated=True, bias=True, residual=True,
        config=config)
    run(16, 96, 4096, 128, "mins", torch.float16, config=config)


@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_linear_dispatch_of_quantized_weights(scheme):
    """ops.triton.linear: up to 64 rows the quantized kernels (with the norm before them),
    beyond them the weight dequantized for cuBLAS; both the composed reference."""
    from frugal.ops.triton.linear import linear, pack_weight
    from frugal.quant.fp8 import quantize_fp8

    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * 0.06
    q = quantize_rtn(w, 64, symmetric=False) if scheme == "int4" else quantize_fp8(w)
    packed = pack_weight(q.to(DEVICE), torch.float32)
    norm = torch.rand(256, generator=g) + 0.5
    for m in (3, 70):
        x = torch.randn(m, 256, generator=g)
        r = torch.randn(m, 48, generator=g)
        ref = torch_ref.linear(x, q, None, norm, 1e-5, True, r.clone())
        got = linear(x.to(DEVICE), packed, None, norm.to(DEVICE), 1e-5, True, r.to(DEVICE))
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_kernel_layouts_reject_what_they_cannot_run():
    """Groups under 16 inputs (INT4) and FP8 blocks that are not whole 128-input tiles get a
    clear error when the weights are packed, not wrong numbers later."""
    from frugal.ops.triton.linear import pack_weight
    from frugal.quant.fp8 import quantize_fp8

    with pytest.raises(ValueError, match="group size 8"):
        pack_weight(quantize_rtn(torch.randn(16, 128), 8, symmetric=True), torch.float32)
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_weight(quantize_fp8(torch.randn(128, 128), 64), torch.float32)
