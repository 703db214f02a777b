"""The DSA kernels (ops.triton.dsa) against torch_ref.dsa on fresh random caches: index scores
and top-k for decode and prompt tokens of several requests (contexts shorter and longer than
the top-k), and sparse MLA over selections with unused (-1) places, on column views of cache
rows wider than the latent (the index key after it, as the model lays them out)."""

import pytest
import torch

from frugal.ops import torch_ref
from tests.ops.test_triton_topk import radix_keys

tri = pytest.importorskip("frugal.ops.triton.dsa")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batch(lens, new, width, page_size=16, seed=0, dtype=torch.float32):
    """A paged cache of rows `width` wide, page tables in random order, and the step's layout:
    request b has new[b] new tokens at the end of its lens[b] positions."""
    g = torch.Generator().manual_seed(seed)
    pages_each = max(-(-n // page_size) for n in lens)
    num_pages = len(lens) * pages_each + 2
    cache = torch.randn(num_pages, page_size, 1, width, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: len(lens) * pages_each]
    table = table.view(len(lens), -1).int()
    cu = torch.tensor([0] + new).cumsum(0).int()
    return g, cache, table, cu, torch.tensor(lens, dtype=torch.int32)


def to(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("radix", [False, True])
@pytest.mark.parametrize("lens,new,topk", [([40, 7, 100], [1, 1, 1], 16),
                                           ([50, 90], [1, 30], 24), ([20], [20], 32),
                                           ([30, 12, 64, 9, 40], [3, 0, 4, 1, 0], 16)])
def test_index_topk_matches_torch_ref(lens, new, topk, radix, monkeypatch):
    """(radix: the top-k by ops.triton.topk, which long contexts take)"""
    if radix:
        monkeypatch.setattr(tri, "RADIX_MIN", 0)
    heads, dim, lat = 16, 16, 24
    g, cache, table, cu, seq_lens = batch(lens, new, lat + dim)
    keys = cache[..., lat:]
    q = torch.randn(sum(new), heads, dim, generator=g)
    w = torch.randn(sum(new), heads, generator=g)
    ref = torch_ref.index_topk(q, w, keys, table, cu, seq_lens, topk, max(lens))
    got = tri.index_topk(*to(DEVICE, q, w), cache.to(DEVICE)[..., lat:],
                         *to(DEVICE, table, cu, seq_lens), topk, max(lens))
    assert got.shape == ref.shape == (sum(new), min(topk, max(lens)))
    assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)
    # every token sees min(its position + 1, topk) positions, all at most its own
    for t, row in enumerate(ref.tolist()):
        b = int((cu[1:] <= t).sum())
        visible = lens[b] - (int(cu[b + 1]) - t) + 1
        chosen = [p for p in row if p >= 0]
        assert len(chosen) == min(visible, topk) and max(chosen) < visible
        assert len(set(chosen)) == len(chosen)


@pytest.mark.parametrize("lens,radix", [([100, 90, 80], True), ([60, 50, 40], False),
                                        ([100, 90, 80, 70], False)])
def test_index_topk_takes_the_radix_within_its_range(lens, radix, monkeypatch):
    """Rows of RADIX_MIN positions or more, while the step holds at most RADIX_MAX scores."""
    calls, real = [], tri.top_positions
    monkeypatch.setattr(tri, "top_positions",
                        lambda s, k, **kw: calls.append(s.shape) or real(s, k, **kw))
    monkeypatch.setattr(tri, "RADIX_MIN", 64)
    monkeypatch.setattr(tri, "RADIX_MAX", 300)
    g, cache, table, cu, seq_lens = batch(lens, [1] * len(lens), 24 + 16)
    q, w = torch.randn(len(lens), 16, 16, generator=g), torch.randn(len(lens), 16, generator=g)
    got = tri.index_topk(*to(DEVICE, q, w), cache.to(DEVICE)[..., 24:],
                         *to(DEVICE, table, cu, seq_lens), 8, max(lens))
    ref = torch_ref.index_topk(q, w, cache[..., 24:], table, cu, seq_lens, 8, max(lens))
    assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)
    assert calls == ([(len(lens), max(lens))] if radix else [])


@pytest.mark.parametrize("block,chunks", [(None, 1), (16, 1), (16, 3)])
def test_index_scores_match_the_formula(block, chunks, monkeypatch):
    """(rows 6 and 7: a padded step's tokens of no request, which see no position; blocks of 16
    positions, one or three a program: 70 positions end inside a program's second block)"""
    if block is not None:
        monkeypatch.setattr(tri, "BLOCK_N", block)
    monkeypatch.setattr(tri, "CHUNKS", chunks)
    heads, dim = 16, 32
    g, cache, table, cu, seq_lens = batch([70, 5], [1, 5], dim)
    q = torch.randn(8, heads, dim, generator=g)
    w = torch.randn(8, heads, generator=g)
    got = tri.index_scores(*to(DEVICE, q, w, cache, table, cu, seq_lens), 70).cpu()
    assert torch.isinf(got[6:]).all()
    rows = cache.view(-1, dim)
    for t, (b, visible) in enumerate([(0, 70), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]):
        slots = table[b].long()[torch.arange(visible) // 16] * 16 + torch.arange(visible) % 16
        want = (torch.relu(q[t] @ rows[slots].T) * w[t, :, None]).sum(0)
        torch.testing.assert_close(got[t, :visible], want, atol=1e-4, rtol=1e-4)
        assert torch.isinf(got[t, visible:]).all()


@pytest.mark.parametrize("chunks", [1, 3])
def test_index_scores_count_the_top_k_first_pass(chunks, monkeypatch):
    """With a work area the score kernel also counts each row's finite scores by the top byte
    of their keys (topk's first histogram; -inf past what a token sees, and the rows of no
    request, counted nowhere), and leaves the rest of the area zero."""
    topk = pytest.importorskip("frugal.ops.triton.topk")
    monkeypatch.setattr(tri, "BLOCK_N", 16)
    monkeypatch.setattr(tri, "CHUNKS", chunks)
    heads, dim = 16, 32
    g, cache, table, cu, seq_lens = batch([70, 5], [1, 5], dim, seed=3)
    q = torch.randn(8, heads, dim, generator=g)
    w = torch.randn(8, heads, generator=g)
    work = topk.work_area(8, DEVICE)
    got = tri.index_scores(*to(DEVICE, q, w, cache, table, cu, seq_lens), 70, work).cpu()
    work = work.cpu()
    visible = [70, 1, 2, 3, 4, 5, 0, 0]
    got = torch.stack([torch.cat([row[:v], torch.full((70 - v,), float("-inf"))])
                       for row, v in zip(got, visible)])  # (past what a token sees: unread)
    keys = radix_keys(got)
    for t in range(8):
        finite = torch.isfinite(got[t])
        want = torch.bincount((keys[t][finite] >> 24), minlength=256)
        assert torch.equal(work[t, :256].long(), want), t
    assert int(work[:, :256].sum()) == int(torch.isfinite(got).sum()) == 70 + 1 + 2 + 3 + 4 + 5
    assert work[:, topk.DEAD.value].tolist() == [70 - v for v in visible]  # (the dead tails)
    work[:, topk.DEAD.value] = 0
    assert not work[:, 256:].any()


@pytest.mark.parametrize("bound", [False, True])
def test_index_topk_in_a_graph_sized_for_longer_contexts(bound, monkeypatch):
    """In a CUDA graph max_seq_len bounds the contexts (here 8x the longest) and the radix
    select runs whatever the step's scores (bound: here over RADIX_MAX); the score kernel then
    leaves every block past a token's context unwritten (NaN-filled here, which the top-k would
    take first if it read them) and selects what torch_ref does."""
    calls, real = [], tri.top_positions
    monkeypatch.setattr(tri, "top_positions",
                        lambda s, k, **kw: calls.append(s.shape) or real(s, k, **kw))
    monkeypatch.setattr(tri, "RADIX_MIN", 64)
    monkeypatch.setattr(tri, "RADIX_MAX", 0 if bound else 1 << 30)
    monkeypatch.setattr(tri, "BLOCK_N", 16)
    empty = torch.empty
    monkeypatch.setattr(tri.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype") == torch.float32 else empty(*a, **k))
    lens, new = [100, 7, 40], [1, 1, 2]
    g, cache, table, cu, seq_lens = batch(lens, new, 24 + 16, seed=4)
    wide = torch.zeros(len(lens), 8 * table.shape[1], dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    q, w = torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, generator=g)
    got = tri.index_topk(*to(DEVICE, q, w), cache.to(DEVICE)[..., 24:],
                         *to(DEVICE, wide, cu, seq_lens), 8, 800, bound=bound)
    ref = torch_ref.index_topk(q, w, cache[..., 24:], wide, cu, seq_lens, 8, 800, bound=bound)
    assert torch.equal(got.cpu().sort(-1).values, ref.sort(-1).values)
    assert calls == [(4, 800)]


@pytest.mark.parametrize("lens,new,k", [([40, 7, 100], [1, 1, 1], 16), ([60, 90], [3, 20], 32),
                                        ([33, 50, 21], [2, 0, 5], 16)])
def test_sparse_mla_attention_matches_torch_ref(lens, new, k):
    heads, lat, rope, index = 20, 32, 16, 16
    g, cache, table, cu, seq_lens = batch(lens, new, lat + rope + index)
    view = cache[..., :lat + rope]
    selection = torch.full((sum(new), k), -1, dtype=torch.int32)
    for t in range(sum(new)):
        b = int((cu[1:] <= t).sum())
        visible = lens[b] - (int(cu[b + 1]) - t) + 1
        take = min(visible, k) - (t % 3 == 1)  # (some rows leave places unused)
        selection[t, :take] = torch.randperm(visible, generator=g)[:take].int()
    selection[0] = selection[0][torch.randperm(k, generator=g)]  # (-1s anywhere)
    q = torch.randn(sum(new), heads, lat + rope, generator=g)
    scale = (lat + rope) ** -0.5
    ref = torch_ref.sparse_mla_attention(q, view, table, cu, selection, scale, lat)
    got = tri.sparse_mla_attention(q.to(DEVICE), cache.to(DEVICE)[..., :lat + rope],
                                   *to(DEVICE, table, cu, selection), scale, lat)
    assert got.shape == (sum(new), heads, lat)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


def test_sparse_selection_of_everything_is_dense_attention():
    """Selecting every visible position: the same as torch_ref.mla_attention."""
    lat, rope, heads = 32, 16, 4
    g, cache, table, cu, seq_lens = batch([30, 12], [1, 12], lat + rope)
    selection = torch.full((13, 30), -1, dtype=torch.int32)
    selection[0] = torch.arange(30).flip(0)
    for i in range(12):
        selection[1 + i, :i + 1] = torch.arange(i + 1)
    q = torch.randn(13, heads, lat + rope, generator=g)
    dense = torch_ref.mla_attention(q, cache, table, cu, seq_lens, 0.2, 12, 30, lat, 1)
    sparse = torch_ref.sparse_mla_attention(q, cache, table, cu, selection, 0.2, lat)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_dsa_kernels_bf16_glm5_shapes_gpu():
    """GLM-5's shapes: 64 heads over [512 | 64] rows + a 128-wide index key, 32 index heads,
    top-2048 of 4,096 and 6,000 positions."""
    lat, rope, index, topk = 512, 64, 128, 2048
    lens, new = [4096, 6000, 3000], [1, 1, 8]
    g, cache, table, cu, seq_lens = batch(lens, new, lat + rope + index, dtype=torch.bfloat16)
    q = torch.randn(10, 32, index, generator=g).bfloat16()
    w = torch.randn(10, 32, generator=g)
    args = (cache[..., lat + rope:], table, cu, seq_lens, topk, max(lens))
    ref = torch_ref.index_topk(q, w, *args)
    got = tri.index_topk(q.cuda(), w.cuda(), cache.cuda()[..., lat + rope:],
                         *to("cuda", table, cu, seq_lens), topk, max(lens)).cpu()
    same = [len(set(a) & set(b)) / len([x for x in b if x >= 0])
            for a, b in zip(got.tolist(), ref.tolist())]
    assert min(same) > 0.99, same  # (bf16 products summed in another order: near-ties swap)
    qa = torch.randn(10, 64, lat + rope, generator=g).bfloat16()
    out = tri.sparse_mla_attention(qa.cuda(), cache.cuda()[..., :lat + rope],
                                   *to("cuda", table, cu, ref), 0.07, lat).cpu()
    want = torch_ref.sparse_mla_attention(qa, cache[..., :lat + rope], table, cu, ref, 0.07, lat)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def fp8_index_keys(keys: torch.Tensor, dim: int) -> torch.Tensor:
    """keys [P, S, 1, dim] -> an FP8 index-key cache [P, S, 1, dim + 16] holding them."""
    out = torch.zeros(*keys.shape[:3], dim + 16, dtype=torch.float8_e4m3fn)
    torch_ref.store_index_key(keys.reshape(-1, dim), out, torch.arange(keys[..., 0].numel()))
    return out


def test_fp8_index_keys_round_trip():
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(3, 16, 1, 32, generator=g) * torch.rand(3, 16, 1, 1, generator=g) * 5
    cache = fp8_index_keys(keys, 32)
    back = torch_ref.dsa.index_key_rows(cache, torch.arange(48))
    err = (back - keys.view(48, 32)).abs() / keys.view(48, 32).abs().amax(-1, keepdim=True)
    assert err.max() < 1 / 16 and err.max() > 0  # (e4m3: 3 mantissa bits, amax at 448)
    torch.testing.assert_close(back.abs().amax(-1), keys.view(48, 32).abs().amax(-1))


@pytest.mark.parametrize("block,chunks", [(None, 1), (16, 3)])
def test_fp8_index_topk_and_mla_match_torch_ref(block, chunks, monkeypatch):
    """FP8 index keys (each with its scale) and an FP8 latent cache (one scale): the kernels
    read them as torch_ref does (the scores also in blocks of 16 positions, three a program)."""
    if block is not None:
        monkeypatch.setattr(tri, "BLOCK_N", block)
    monkeypatch.setattr(tri, "CHUNKS", chunks)
    heads, dim, lat, rope = 16, 16, 32, 16
    lens, new = [70, 30], [1, 6]
    g, cache, table, cu, seq_lens = batch(lens, new, lat + rope + dim)
    fp8 = torch.zeros(*cache.shape[:3], lat + rope + dim + 16, dtype=torch.float8_e4m3fn)
    kv_scales = torch.tensor([[0.01], [0.01]])
    slots = torch.arange(cache[..., 0].numel())
    torch_ref.store_latent(cache[..., :lat + rope].reshape(-1, 1, lat + rope),
                           fp8[..., :lat + rope], slots, kv_scales)
    torch_ref.store_index_key(cache[..., lat + rope:].reshape(-1, dim), fp8[..., lat + rope:],
                              slots)
    q = torch.randn(7, heads, dim, generator=g)
    w = torch.randn(7, heads, generator=g)
    keys = fp8[..., lat + rope:]
    ref = torch_ref.index_topk(q, w, keys, table, cu, seq_lens, 16, 70)
    got = tri.index_topk(*to(DEVICE, q, w), fp8.to(DEVICE)[..., lat + rope:],
                         *to(DEVICE, table, cu, seq_lens), 16, 70)
    torch.testing.assert_close(got.cpu().sort(-1).values, ref.sort(-1).values, atol=0, rtol=0)
    qa = torch.randn(7, 20, lat + rope, generator=g)
    want = torch_ref.sparse_mla_attention(qa, fp8[..., :lat + rope], table, cu, ref, 0.1, lat,
                                          kv_scales)
    out = tri.sparse_mla_attention(qa.to(DEVICE), fp8.to(DEVICE)[..., :lat + rope],
                                   *to(DEVICE, table, cu, ref), 0.1, lat,
                                   kv_scales.to(DEVICE))
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    from frugal.ops.triton.mla_decode import mla_attention
    dense = torch_ref.mla_attention(qa[:1], fp8[..., :lat + rope], table[:1], cu[:2],
                                    seq_lens[:1], 0.1, 1, 70, lat, 1, kv_scales)
    got = mla_attention(qa[:1].to(DEVICE), fp8.to(DEVICE)[..., :lat + rope],
                        *to(DEVICE, table[:1], cu[:2], seq_lens[:1]), 0.1, 1, 70, lat, 1,
                        kv_scales.to(DEVICE))
    torch.testing.assert_close(got.cpu(), dense, atol=1e-4, rtol=1e-4)
