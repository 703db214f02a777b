"""Triton norm / activation against torch_ref on fresh random inputs."""

import pytest
import torch

from frugal.ops import torch_ref

tri = pytest.importorskip("frugal.ops.triton.elementwise")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm(dtype, hidden):
    x, w = rand(7, hidden, dtype=dtype, seed=1), rand(hidden, dtype=dtype, seed=3)
    tol = TOL[dtype]
    # (Triton's CPU interpreter truncates fp32 -> bf16 where GPUs round: one ulp apart there)
    torch.testing.assert_close(tri.rms_norm(x, w, 1e-5), torch_ref.rms_norm(x, w, 1e-5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(5, 512), (3, 2, 64)])
def test_rms_norm_of_strided_rows(shape):
    """Rows that are a split of wider rows (MLA's latent beside its rotary key) or a 3-d view:
    read in place, the result contiguous and equal to torch_ref's."""
    wide = rand(*shape[:-1], shape[-1] + 64, dtype=torch.float32, seed=5)
    x, w = wide[..., :shape[-1]], rand(shape[-1], dtype=torch.float32, seed=6)
    got = tri.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, torch_ref.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = rand(5, 2 * 1536, dtype=dtype, seed=4)
    torch.testing.assert_close(tri.silu_and_mul(x), torch_ref.silu_and_mul(x), atol=TOL[dtype],
                               rtol=TOL[dtype])
