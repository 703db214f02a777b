"""The one-launch rotary (ops.triton.rotary) against torch_ref's on fresh random inputs: NeoX
halves with full and partial rotary, DeepSeek's adjacent pairs, queries and keys as strided views
of wider rows (as MLA splits them), one key head or several, fp32 and bf16, any positions."""

import pytest
import torch

tri = pytest.importorskip("frugal.ops.triton.rotary")
from frugal.ops import torch_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(tokens, q_heads, k_heads, width, rot, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # q: the last `width` dims of rows of q_heads * (16 + width), as MLA's q_rope is
    q = torch.randn(tokens, q_heads, 16 + width, generator=g).to(dtype)[..., 16:]
    k = torch.randn(tokens, k_heads, width + 8, generator=g).to(dtype)[..., :width]
    angles = torch.rand(300, rot // 2, generator=g) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    return [t.to(DEVICE) for t in (q, k, positions, cos_sin)]


@pytest.mark.parametrize("pairs,width,rot", [(False, 64, 64), (False, 32, 16), (True, 64, 64),
                                             (True, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,q_heads,k_heads", [(5, 16, 1), (3, 6, 2), (1, 64, 1)])
def test_matches_torch_ref(pairs, width, rot, dtype, tokens, q_heads, k_heads):
    q, k, positions, cos_sin = inputs(tokens, q_heads, k_heads, width, rot, dtype,
                                      seed=tokens * 100 + width)
    name = "apply_rotary_pairs" if pairs else "apply_rotary"
    want_q, want_k = getattr(torch_ref, name)(q, k, positions, cos_sin)
    got_q, got_k = getattr(tri, name)(q, k, positions, cos_sin)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert got_q.dtype == dtype and got_k.dtype == dtype
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert q.is_contiguous() is False  # (the inputs stayed as they were)


def test_no_tokens_and_bad_shapes():
    q, k, positions, cos_sin = inputs(0, 4, 1, 16, 16, torch.float32, seed=1)
    got_q, got_k = tri.apply_rotary(q, k, positions, cos_sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    q, k, positions, cos_sin = inputs(2, 4, 1, 32, 16, torch.float32, seed=2)
    with pytest.raises(ValueError):  # (pairs rotate every dim)
        tri.apply_rotary_pairs(q, k, positions, cos_sin)
    with pytest.raises(ValueError):  # (positions read as contiguous)
        tri.apply_rotary(q, k, torch.stack([positions, positions], 1)[:, 0], cos_sin)
    with pytest.raises(ValueError):  # (an odd rotary width: torch_ref cannot halve it either)
        tri.apply_rotary(q, k, positions, cos_sin[:, :15])
