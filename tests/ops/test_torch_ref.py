"""torch_ref ops against dense, obviously-correct formulations on fresh random inputs."""

import pytest
import torch
import torch.nn.functional as F

from frugal.ops import torch_ref


def make_paged(seq_lens, num_kv_heads, head_dim, page_size, dtype, seed):
    """Random K/V per request, scattered into shuffled pages of a NaN-poisoned pool."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages_per) + 3
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    order = torch.randperm(num_pages, generator=g).tolist()
    tables, ks, vs = [], [], []
    for n, p in zip(seq_lens, pages_per):
        table = [order.pop() for _ in range(p)]
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = torch.tensor([table[i // page_size] * page_size + i % page_size for i in range(n)])
        torch_ref.store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    width = max(pages_per)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, page_table, ks, vs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_dense(dtype, tol, seed):
    num_heads, num_kv_heads, head_dim, page_size = 6, 2, 16, 4
    seq_lens = [1, 9, 17, 5, 30, 3]
    num_new = [1, 1, 17, 1, 7, 3]  # decodes, a full prefill, chunks on top of cached tokens
    k_cache, v_cache, page_table, ks, vs = make_paged(seq_lens, num_kv_heads, head_dim, page_size,
                                                      dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist(), dtype=torch.int32)
    scale = head_dim ** -0.5
    out = torch_ref.paged_attention(q, k_cache, v_cache, page_table, cu,
                                    torch.tensor(seq_lens, dtype=torch.int32), scale,
                                    max(num_new), max(seq_lens))
    assert torch.isfinite(out).all()
    for b, (n, length) in enumerate(zip(num_new, seq_lens)):
        qb = q[cu[b]:cu[b + 1]].float().transpose(0, 1)
        k, v = ks[b].float().transpose(0, 1), vs[b].float().transpose(0, 1)
        mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        ref = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_tokens", [1, 16, 128, 129, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(num_tokens, bias):
    g = torch.Generator().manual_seed(num_tokens)
    x, w = torch.randn(num_tokens, 48, generator=g), torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    y = torch_ref.linear(x, w, b)
    assert y.is_contiguous() and y.shape == (num_tokens, 80)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_rms_norm():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    ref = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(torch_ref.rms_norm(x, w, 1e-6), ref)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_linear_fused_neighbours(num_tokens):
    """norm before, then gate/up SiLU, then the residual add: the same as the ops composed."""
    g = torch.Generator().manual_seed(num_tokens)
    x, w = torch.randn(num_tokens, 48, generator=g), torch.randn(80, 48, generator=g)
    b, n, r = torch.randn(80, generator=g), torch.randn(48, generator=g), torch.randn(
        num_tokens, 40, generator=g)
    y = torch_ref.linear(x, w, b, norm=n, eps=1e-6, gated=True, residual=r)
    normed = n * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = F.linear(normed, w, b).chunk(2, dim=-1)
    torch.testing.assert_close(y, r + F.silu(gate) * up, atol=1e-4, rtol=1e-5)


def test_silu_and_mul():
    x = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(torch_ref.silu_and_mul(x), F.silu(x[:, :10]) * x[:, 10:])


def test_rotary_matches_rotate_half_formulation():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(7, 4, 16, generator=g), torch.randn(7, 2, 16, generator=g)
    positions = torch.tensor([0, 1, 2, 5, 9, 100, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    freqs = torch.arange(128).float()[:, None] * inv_freq
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    q2, k2 = torch_ref.apply_rotary(q, k, positions, cos_sin)
    emb = torch.cat([freqs, freqs], -1)[positions][:, None]

    def rotate_half(x):
        return torch.cat([-x[..., 8:], x[..., :8]], -1)

    torch.testing.assert_close(q2, q * emb.cos() + rotate_half(q) * emb.sin())
    torch.testing.assert_close(k2, k * emb.cos() + rotate_half(k) * emb.sin())
