"""The Triton linear (fused decode GEMV and the cuBLAS path) against torch_ref.linear."""

import pytest
import torch

from frugal.ops import torch_ref

tri = pytest.importorskip("frugal.ops.triton.linear")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLAGS = [  # (norm, bias, gated, residual)
    (False, False, False, False), (True, False, False, False), (False, True, False, True),
    (True, False, True, False), (True, True, True, True), (False, False, False, True)]


def make(m, n, k, dtype, norm, bias, gated, residual, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    return dict(x=rand(m, k), weight=rand(rows, k, scale=k ** -0.5),
                bias=rand(rows) if bias else None, norm=rand(k) + 1 if norm else None,
                eps=1e-5, gated=gated, residual=rand(m, n) if residual else None)


def reference(args):
    return torch_ref.linear(**{**args, **{k: v.float() for k, v in args.items()
                                          if isinstance(v, torch.Tensor)}})


def check(got, ref, dtype):
    assert got.shape == ref.shape
    if ref.numel() == 0:
        return
    # the fused kernel keeps the matmul's fp32 result through the epilogue where the composed
    # ops round it to the activation dtype: a few bf16 ulps of the output's scale apart
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,bias,gated,residual", FLAGS)
def test_gemv_matches_torch_ref(dtype, norm, bias, gated, residual):
    # sizes off the block multiples: masked tails in both N and K
    args = make(1, 20, 96, dtype, norm, bias, gated, residual, seed=int(norm) + 2 * int(gated))
    ref = reference(args)
    got = tri.gemv(**args, config=(8, 64, 4, 1, 2))
    assert got.shape == (1, 20)
    check(got, ref, dtype)


@pytest.mark.parametrize("m", [0, 1, 5])
@pytest.mark.parametrize("norm,bias,gated,residual", FLAGS[2:4] + FLAGS[5:])
def test_linear_dispatch_matches_torch_ref(m, norm, bias, gated, residual):
    """One row takes the GEMV, several the cuBLAS path (which may reuse the residual's
    storage): both are the composed ops."""
    args = make(m, 24, 64, torch.bfloat16, norm, bias, gated, residual, seed=m)
    ref = reference(args)
    check(tri.linear(**args), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (14336, 4096, True),
                                       (4096, 14336, False), (128256, 4096, False)])
def test_gemv_real_shapes(n, k, gated):
    args = make(1, n, k, torch.bfloat16, not gated or k == 4096, False, gated, k == 14336, seed=n)
    ref = reference(args)
    check(tri.linear(**args), ref, torch.bfloat16)


@pytest.mark.parametrize("m", [2, 5, 17])
@pytest.mark.parametrize("norm,bias,gated,residual", FLAGS)
@pytest.mark.parametrize("split", [1, 3])
def test_small_m_matches_torch_ref(m, norm, bias, gated, residual, split):
    """The tensor-core kernel for decode batches; N and K off the block multiples; K's 5 tiles
    split 3 ways (2 + 2 + 1), summed by the last program of each block, the counters left 0."""
    from frugal.ops.triton import split_k

    args = make(m, 40, 160, torch.bfloat16, norm, bias, gated, residual, seed=m + int(gated))
    ref = reference(args)
    got = tri.small_m_linear(**args, config=(32, 32, 4, 2, split))
    assert got.shape == (m, 40)
    check(got, ref, torch.bfloat16)
    assert not split_k.counters(got.device).any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 24, 64])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (14336, 4096, True)])
def test_small_m_real_shapes(m, n, k, gated):
    args = make(m, n, k, torch.bfloat16, True, False, gated, False, seed=n + m)
    ref = reference(args)
    check(tri.linear(**args), ref, torch.bfloat16)
