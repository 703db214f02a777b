"""Triton paged attention and KV store against their torch_ref twins on fresh random inputs.
On CPU they run in Triton's interpreter at tiny shapes; marked gpu, at real shapes on the GPU."""

import pytest
import torch

from frugal.ops import torch_ref

triton_attention = pytest.importorskip("frugal.ops.triton.attention")
kv_store = pytest.importorskip("frugal.ops.triton.kv_store")
fp8_decode = pytest.importorskip("frugal.ops.triton.fp8_decode")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def tol_8bit(dtype: torch.dtype) -> float:
    """The bound for attention over a cache of 8-bit rows: on a GPU the kernels take q·k (and
    p·v over rows with their own scale) in fp16 or bf16 whatever q's dtype (kv_blocks.dot_dtype),
    so fp32 takes bf16's there (fp32 q rounded to fp16 alone moves outputs of magnitude 10 by
    up to 0.02: torch_ref on the rounded q, on the CPU)."""
    return TOL[torch.bfloat16 if DEVICE == "cuda" else dtype]


FP8 = torch.float8_e4m3fn


def make_case(seq_lens, num_new, num_heads, num_kv_heads, head_dim, page_size, dtype, seed,
              scales=None, caches=None):
    """A poisoned pool with each request's K/V in shuffled pages, and the step's q.
    scales ([2, num_kv_heads]): the pool is FP8 (V key-minor), K/V quantized with them; its
    poison is the largest finite value (an FP8 pool never holds NaN, so kernels may read the
    unused rows of a request's last page), a bf16/fp32 pool's NaN. caches: a function
    (num_pages) -> (k_cache, v_cache) on the CPU, poisoned as it likes, instead."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per) + 2
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    if caches is not None:
        k_cache, v_cache = caches(num_pages)
    elif scales is None:
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
    else:
        k_cache = torch.full(shape, 0x7E, dtype=torch.uint8).view(FP8)  # e4m3fn 448
        v_cache = k_cache.permute(0, 2, 3, 1).contiguous()  # key-minor
    order = torch.randperm(num_pages, generator=g).tolist()
    tables = []
    for n, p in zip(seq_lens, pages_per):
        table = [order.pop() for _ in range(p)]
        slots = torch.tensor([table[i // page_size] * page_size + i % page_size
                              for i in range(n)])
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        torch_ref.store_kv(k * 3, v * 3, k_cache, v_cache, slots, scales)
        tables.append(table)
    width = max(pages_per) + 1  # a padded tail, as the runner builds it
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(num_new), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, page_table, cu, lens)]


def fp8_scales(num_kv_heads, seed):
    """Per-head K and V scales around what |x| <= 12 needs (amax / 448)."""
    g = torch.Generator().manual_seed(seed)
    return (12 / 448) * (0.5 + torch.rand(2, num_kv_heads, generator=g))


CASES = [  # (seq_lens, num_new, heads, kv_heads, head_dim, page_size)
    ([1, 37, 16, 70], [1, 1, 1, 1], 6, 2, 16, 4),  # decode, GQA, pages smaller than a block
    ([200, 5], [1, 1], 4, 4, 32, 16),  # decode, MHA, long enough to split
    ([17, 40, 9], [17, 8, 1], 6, 2, 16, 4),  # prefill, extend on a cache, and a decode
    ([70], [70], 8, 2, 64, 16),  # one longer prefill spanning several blocks
    ([50, 9], [20, 1], 6, 2, 16, 4),  # extend blocks of 16 tokens x a group of 3 (padded to 4)
    ([150, 20], [150, 20], 4, 4, 32, 16),  # MHA prefill in blocks of 64 tokens
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_matches_torch_ref(case, dtype):
    seq_lens, num_new, heads, kv_heads, dim, page = CASES[case]
    q, k_cache, v_cache, table, cu, lens = make_case(seq_lens, num_new, heads, kv_heads, dim,
                                                     page, dtype, seed=case)
    args = (q, k_cache, v_cache, table, cu, lens, dim ** -0.5, max(num_new), max(seq_lens))
    ours = triton_attention.paged_attention(*args)
    ref = torch_ref.paged_attention(*args)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_fp8_cache_matches_torch_ref(case, dtype):
    """FP8 K/V widened in registers, K scale in the softmax scale, V scale on the output: the
    same as dequantizing the cache first."""
    seq_lens, num_new, heads, kv_heads, dim, page = CASES[case]
    scales = fp8_scales(kv_heads, seed=case)
    q, k_cache, v_cache, table, cu, lens = make_case(seq_lens, num_new, heads, kv_heads, dim,
                                                     page, dtype, seed=case, scales=scales)
    args = (q, k_cache, v_cache, table, cu, lens, dim ** -0.5, max(num_new), max(seq_lens))
    ours = triton_attention.paged_attention(*args, scales.to(DEVICE))
    ref = torch_ref.paged_attention(*args, scales.to(DEVICE))
    assert torch.isfinite(ours).all()
    tol = tol_8bit(dtype)
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="kv_scales"):
        triton_attention.paged_attention(*args)


@pytest.mark.parametrize("fp8", [False, True])
def test_mixed_batch_runs_its_leading_decodes_in_the_decode_kernel(fp8):
    """Decodes at the front of a batch with prompt chunks go to the decode kernel (here split:
    few requests), the rest (a later decode too) to the extend kernel: same result either way."""
    seq_lens, num_new = [300, 37, 20, 9], [1, 1, 12, 1]
    scales = fp8_scales(2, seed=5) if fp8 else None
    q, k_cache, v_cache, table, cu, lens = make_case(seq_lens, num_new, 6, 2, 16, 4,
                                                     torch.bfloat16, seed=5, scales=scales)
    args = (q, k_cache, v_cache, table, cu, lens, 16 ** -0.5, max(num_new), max(seq_lens),
            None if scales is None else scales.to(DEVICE))
    ref = torch_ref.paged_attention(*args)
    for num_decodes in (0, 2):
        ours = triton_attention.paged_attention(*args, num_decodes)
        torch.testing.assert_close(ours.float(), ref.float(), atol=TOL[torch.bfloat16],
                                   rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("fp8", [False, True])
def test_a_padded_prompt_step_leaves_its_padding_zero(fp8, monkeypatch):
    """A step as worker.prompt_graphs pads it: token rows past the last request's (in no
    request) and requests with no new tokens and seq_len 0 (their page-table rows zero), the
    grid sized for the padded token count, every request through the prompt kernel. The real
    rows are the unpadded step's; the padding rows are zeros (the prompt kernel's items past
    the last write them), not what the output's memory held: NaN here."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like",
                        lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))
    seq_lens, num_new = [37, 20, 9], [1, 12, 1]
    scales = fp8_scales(2, seed=6) if fp8 else None
    q, k_cache, v_cache, table, cu, lens = make_case(seq_lens, num_new, 6, 2, 16, 4,
                                                     torch.bfloat16, seed=6, scales=scales)
    kv = None if scales is None else scales.to(DEVICE)
    real = torch_ref.paged_attention(q, k_cache, v_cache, table, cu, lens, 16 ** -0.5,
                                     max(num_new), max(seq_lens), kv, 1)
    tokens, requests = 32, 5  # (the graph's bucket: 14 tokens of 3 requests padded)
    q_pad = torch.cat([q, torch.full((tokens - q.shape[0], *q.shape[1:]), float("nan"),
                                     dtype=q.dtype, device=q.device)])
    cu_pad = torch.cat([cu, cu[-1:].repeat(requests - 3)])
    lens_pad = torch.cat([lens, lens.new_zeros(requests - 3)])
    table_pad = torch.cat([table, table.new_zeros(requests - 3, table.shape[1])])
    for impl in (torch_ref, triton_attention):
        out = impl.paged_attention(q_pad, k_cache, v_cache, table_pad, cu_pad, lens_pad,
                                   16 ** -0.5, tokens, 4 * table.shape[1], kv, 0)
        torch.testing.assert_close(out[:q.shape[0]].float(), real.float(),
                                   atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        assert bool((out[q.shape[0]:] == 0).all())


@pytest.mark.parametrize("requests", [15, 16, 17])
def test_extend_work_items_cover_many_requests(requests):
    """The extend kernel's programs are work items laid out request after request (a grid of
    one per block of the step's tokens plus one a request): 15 to 17 prompt chunks of 1 to 9
    tokens (around the 16 requests it reads at a time), some items past the last."""
    num_new = [1 + (7 * i) % 9 for i in range(requests)]
    seq_lens = [n + (5 * i) % 13 for i, n in enumerate(num_new)]
    q, k_cache, v_cache, table, cu, lens = make_case(seq_lens, num_new, 4, 2, 16, 4,
                                                     torch.float32, seed=requests)
    args = (q, k_cache, v_cache, table, cu, lens, 16 ** -0.5, max(num_new), max(seq_lens))
    torch.testing.assert_close(triton_attention.paged_attention(*args),
                               torch_ref.paged_attention(*args), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("min_split", [64, 256])
def test_decode_split_counts_agree(splits, min_split, monkeypatch):
    """Any split count (a CUDA graph's may exceed what a short context needs) and any minimum
    split length give the same attention."""
    monkeypatch.setattr(triton_attention, "_MIN_SPLIT", min_split)
    q, k_cache, v_cache, table, cu, lens = make_case([150, 33], [1, 1], 4, 2, 16, 16,
                                                     torch.float32, seed=9)
    monkeypatch.setattr(triton_attention, "num_decode_splits", lambda *a: splits)
    ours = triton_attention.paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25, 1, 150)
    ref = torch_ref.paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25, 1, 150)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)


def test_many_decodes_split_in_longer_slices(monkeypatch):
    """17 requests x 2 KV heads (34 programs): slices of at least 128 keys (min_split_keys),
    so the 7 slices a CUDA graph's longest context asks for cut contexts of 40 to 330 keys
    into 1 to 3 live ones; the merge reads just those. 128 programs and more: one slice."""
    assert triton_attention.min_split_keys(17, 2) == 128
    assert triton_attention.min_split_keys(16, 2) == 64
    assert triton_attention.num_decode_splits(64, 2, 4096) == 1
    lens = [40 + 18 * i for i in range(17)]
    q, k_cache, v_cache, table, cu, lens_t = make_case(lens, [1] * 17, 4, 2, 16, 16,
                                                       torch.float32, seed=11)
    monkeypatch.setattr(triton_attention, "num_decode_splits", lambda *a: 7)
    args = (q, k_cache, v_cache, table, cu, lens_t, 0.25, 1, 4096)
    torch.testing.assert_close(triton_attention.paged_attention(*args),
                               torch_ref.paged_attention(*args), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["views", "packed", "qk_norm"])
@pytest.mark.parametrize("rotary_dim", [32, 16, 12])
def test_rotary_store_kv_matches_torch_ref(dtype, form, rotary_dim):
    """Views of one fused qkv row (as the model passes them), packed tensors, or views with
    Qwen3's per-head RMSNorm of q and k fused in; a negative slot stores nothing but its q is
    still rotated. rotary_dim < 32: partial rotary (GLM), the other dims pass through."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 6, 2, 32, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (x.reshape(tokens, -1, dim) for x in (q, k, v))
    if form == "packed":
        q, k = q.contiguous(), k.contiguous()
    qk_norm = None
    if form == "qk_norm":
        qk_norm = (torch.rand(dim, generator=g).add(0.5).to(dtype),
                   torch.rand(dim, generator=g).add(0.5).to(dtype), 1e-6)
    positions = torch.tensor([0, 7, 300, 5, 1023])
    slots = torch.tensor([3, 0, -1, 9, 12])
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(1024).float()[:, None] * inv
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    ref_k, ref_v = torch.zeros(4, 4, kv_heads, dim, dtype=dtype), torch.zeros(4, 4, kv_heads, dim,
                                                                              dtype=dtype)
    ref_q = torch_ref.rotary_store_kv(q, k, v, positions, cos_sin, ref_k, ref_v, slots,
                                      qk_norm=qk_norm)
    k_cache, v_cache = torch.zeros_like(ref_k).to(DEVICE), torch.zeros_like(ref_v).to(DEVICE)
    ours = kv_store.rotary_store_kv(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                    positions.to(DEVICE), cos_sin.to(DEVICE), k_cache, v_cache,
                                    slots.to(DEVICE), qk_norm=qk_norm and (
                                        qk_norm[0].to(DEVICE), qk_norm[1].to(DEVICE), 1e-6))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.cpu(), ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.cpu(), ref_k, atol=tol, rtol=tol)
    assert torch.equal(v_cache.cpu(), ref_v)
    if qk_norm is not None:
        return
    # the dims past rotary_dim are q's and k's own
    assert torch.equal(ref_q[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(ref_k.view(-1, kv_heads, dim)[slots[1]][..., rotary_dim:],
                       k[1, :, rotary_dim:])


def test_rotary_store_kv_fp8_quantizes_and_saturates():
    """The FP8 store divides by each head's scale and saturates at ±448 (never NaN)."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    q = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, generator=g).to(torch.bfloat16)
    k[0, 1, 3], v[2, 0, 5] = 1e4, -1e4  # far beyond 448 · scale
    v[1, 1, 2] = float("nan")  # stored as 0: an FP8 pool never holds NaN
    positions, slots = torch.tensor([0, 3, 9]), torch.tensor([5, 0, 2])
    freqs = torch.arange(16).float()[:, None] * (1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    scales = fp8_scales(kv_heads, seed=1)
    ref_k = torch.zeros(2, 4, kv_heads, dim, dtype=FP8)
    ref_v = torch.zeros(2, kv_heads, dim, 4, dtype=FP8)  # key-minor
    torch_ref.rotary_store_kv(q, k, v, positions, cos_sin, ref_k, ref_v, slots, scales)
    k_cache, v_cache = torch.zeros_like(ref_k).to(DEVICE), torch.zeros_like(ref_v).to(DEVICE)
    kv_store.rotary_store_kv(*(t.to(DEVICE) for t in (q, k, v, positions, cos_sin)), k_cache,
                             v_cache, slots.to(DEVICE), scales.to(DEVICE))
    for ours, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        ours, ref = ours.cpu().float(), ref.float()
        assert torch.isfinite(ours).all() and torch.isfinite(ref).all()
    assert float(v_cache.cpu().float()[0, 1, 2, 0]) == 0.0 == float(ref_v.float()[0, 1, 2, 0])
    for ours, ref in ((k_cache, ref_k), (v_cache, ref_v)):
        ours, ref = ours.cpu().float(), ref.float()
        assert ref.abs().max() == 448
        # within one FP8 step (1/8 relative); Triton's CPU interpreter converts fp32 -> fp8
        # wrongly for some values, so there a few may be further off
        off = ~torch.isclose(ours, ref, atol=2e-2, rtol=0.13)
        assert off.sum() <= (0 if DEVICE == "cuda" else ours.numel() // 100), ours[off]


@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq_len", [(1, 32768), (64, 4096), (8, 1000)])
@pytest.mark.parametrize("fp8", [False, True])
def test_real_shapes_on_gpu(batch, seq_len, fp8):
    """Llama-3.1-8B attention shape (32 q heads, 8 KV heads, d=128), bf16 queries, a bf16 or
    FP8 cache, page 16."""
    lens = [seq_len - 7 * i for i in range(batch)]
    scales = fp8_scales(8, seed=batch) if fp8 else None
    q, k_cache, v_cache, table, cu, lens_t = make_case(lens, [1] * batch, 32, 8, 128, 16,
                                                       torch.bfloat16, seed=batch, scales=scales)
    args = (q, k_cache, v_cache, table, cu, lens_t, 128 ** -0.5, 1, max(lens),
            None if scales is None else scales.to(DEVICE))
    torch.testing.assert_close(triton_attention.paged_attention(*args).float(),
                               torch_ref.paged_attention(*args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fp8_prefill_on_gpu():
    """Extend over an FP8 cache at a real shape: a 1000-token prefill after 300 cached."""
    scales = fp8_scales(8, seed=3)
    q, k_cache, v_cache, table, cu, lens_t = make_case([1300], [1000], 32, 8, 128, 16,
                                                       torch.bfloat16, seed=3, scales=scales)
    args = (q, k_cache, v_cache, table, cu, lens_t, 128 ** -0.5, 1000, 1300, scales.to(DEVICE))
    torch.testing.assert_close(triton_attention.paged_attention(*args).float(),
                               torch_ref.paged_attention(*args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("pages", [1, 2, 4])
@pytest.mark.parametrize("heads, kv_heads, dim, page", [(32, 8, 128, 16), (9, 3, 64, 16),
                                                        (16, 2, 128, 32), (8, 8, 256, 16)])
@pytest.mark.parametrize("splits", [None, 1, 5, 64])
def test_fp8_decode_kernel_on_gpu(pages, heads, kv_heads, dim, page, splits, monkeypatch):
    """The FP8 decode kernel (fp8_decode) in each variant: keys per step, its own split count,
    one split (its output written directly) or many, groups of 1-8 heads, d of 64-256, pages of
    16 and 32, context lengths around page and block edges."""
    monkeypatch.setattr(fp8_decode, "PAGES", pages)
    if splits is not None:
        monkeypatch.setattr(fp8_decode, "split_count", lambda *_: splits)
    lens = [1, 15, 16, 17, 33, 100, 1000, 2049]
    scales = fp8_scales(kv_heads, seed=pages)
    q, k_cache, v_cache, table, cu, lens_t = make_case(lens, [1] * len(lens), heads, kv_heads,
                                                       dim, page, torch.bfloat16, seed=dim,
                                                       scales=scales)
    assert fp8_decode.fits(q, heads // kv_heads, dim, page)
    args = (q, k_cache, v_cache, table, cu, lens_t, dim ** -0.5, 1, max(lens), scales.to(DEVICE))
    ours = triton_attention.paged_attention(*args)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), torch_ref.paged_attention(*args).float(),
                               atol=2e-2, rtol=2e-2)
