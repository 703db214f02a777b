"""KV rows that carry their own scale (fp8_per_token_head, int8_per_token_head, fp8_v): the
torch_ref store and attention against an unquantized cache, and the Triton store and attention
against torch_ref (in the interpreter on CPU at tiny shapes, marked gpu at real shapes on the
GPU)."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.ops.torch_ref.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows
from tests.ops.test_triton_attention import make_case as attention_case
from tests.ops.test_triton_attention import tol_8bit

triton_attention = pytest.importorskip("frugal.ops.triton.attention")
kv_store = pytest.importorskip("frugal.ops.triton.kv_store")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8, INT8 = torch.float8_e4m3fn, torch.int8
FORMATS = ["int8", "fp8", "fp8_v"]


def caches(fmt: str, num_pages: int, page_size: int, heads: int, dim: int, dtype: torch.dtype,
           poison: bool = True, device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of a format, as the pool makes them (fp8_v: strided views of one row
    [K in dtype | V's e4m3 row]); unwritten memory poisoned with large finite bytes."""
    fill = 0x55 if poison else 0  # (as floats and fp8: finite; as scales: finite)
    if fmt == "fp8_v":
        k_bytes = dim * dtype.itemsize
        rows = torch.full((num_pages, page_size, heads, k_bytes + dim + SCALE_BYTES), fill,
                          dtype=torch.uint8, device=device)
        return rows[..., :k_bytes].view(dtype), rows[..., k_bytes:].view(FP8)
    shape = (num_pages, page_size, heads, dim + SCALE_BYTES)
    q_dtype = INT8 if fmt == "int8" else FP8
    return tuple(torch.full(shape, fill, dtype=torch.uint8, device=device).view(q_dtype)
                 for _ in range(2))


def test_rows_round_trip_within_one_step_of_the_format():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 16, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[0, 0] = 0.0
    x[1, 1, 4] = float("nan")
    for dtype, rel in ((INT8, 0.5 / 127), (FP8, 1 / 16)):
        rows = quantize_rows(x, dtype)
        assert rows.shape == (50, 3, 16 + SCALE_BYTES) and rows.dtype == dtype
        back = dequantize_rows(rows)
        want = x.nan_to_num(0.0)
        amax = want.abs().amax(-1, keepdim=True)
        assert torch.equal(back[0, 0], torch.zeros(16))
        assert (back - want).abs().le(amax * rel + 1e-6).all() if dtype == INT8 else \
            (back - want).abs().le(want.abs() * rel + amax / 448 / 8).all()
        assert torch.allclose(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_ref_attention_over_row_scaled_cache_is_close_to_unquantized(fmt):
    """Store and attend through a quantized cache: close to the same over an fp32 cache."""
    g = torch.Generator().manual_seed(1)
    pages, page_size, heads, kv_heads, dim, n = 8, 4, 4, 2, 16, 23
    k, v = (torch.randn(n, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(n, heads, dim, generator=g)
    slots = torch.randperm(pages * page_size, generator=g)[:n]
    ref_k, ref_v = (torch.zeros(pages, page_size, kv_heads, dim) for _ in range(2))
    k_cache, v_cache = caches(fmt, pages, page_size, kv_heads, dim, torch.float32,
                              device="cpu")
    torch_ref.store_kv(k, v, ref_k, ref_v, slots)
    torch_ref.store_kv(k, v, k_cache, v_cache, slots)
    read = torch_ref.attention._gather(v_cache, slots, None, False, True)
    assert torch.allclose(read, v, atol=0.1 if fmt != "int8" else 0.03)
    if fmt == "fp8_v":  # K is kept exactly
        assert torch.equal(k_cache.reshape(-1, kv_heads, dim)[slots], k)
    # one prompt whose tokens sit in the shuffled slots: pages in table order
    table = torch.arange(pages, dtype=torch.int32)[None]
    for cache_k, cache_v in ((ref_k, ref_v), (k_cache, v_cache)):
        flat_k = cache_k.view(-1, *cache_k.shape[2:])
        flat_v = cache_v.view(-1, *cache_v.shape[2:])
        flat_k[:n], flat_v[:n] = flat_k[slots].clone(), flat_v[slots].clone()
    args = (table, torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32), dim ** -0.5, n, n)
    ref = torch_ref.paged_attention(q, ref_k, ref_v, *args)
    ours = torch_ref.paged_attention(q, k_cache, v_cache, *args)
    assert (ours - ref).abs().max() < (0.04 if fmt == "int8" else 0.15)
    assert (ours - ref).abs().max() > 0  # (it did quantize)


def make_case(fmt, seq_lens, num_new, heads, kv_heads, dim, page_size, dtype, seed):
    """Each request's K/V stored by torch_ref in shuffled pages of a poisoned pool of the
    format, and q (test_triton_attention.make_case)."""
    return attention_case(seq_lens, num_new, heads, kv_heads, dim, page_size, dtype, seed,
                          caches=lambda n: caches(fmt, n, page_size, kv_heads, dim, dtype,
                                                  device="cpu"))


CASES = [  # (seq_lens, num_new, heads, kv_heads, head_dim, page_size)
    ([1, 37, 16, 70], [1, 1, 1, 1], 6, 2, 16, 4),  # decode, GQA
    ([200, 5], [1, 1], 4, 4, 32, 16),  # decode, long enough to split
    ([17, 40, 9], [17, 8, 1], 6, 2, 16, 4),  # prefill, extend on a cache (a prefix hit), decode
    ([70], [70], 8, 2, 64, 16),  # a prefill over several blocks, chunks of whole pages
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_attention_reads_row_scales_as_torch_ref(case, dtype, fmt):
    seq_lens, num_new, heads, kv_heads, dim, page = CASES[case]
    q, k_cache, v_cache, table, cu, lens = make_case(fmt, seq_lens, num_new, heads, kv_heads,
                                                     dim, page, dtype, seed=case)
    args = (q, k_cache, v_cache, table, cu, lens, dim ** -0.5, max(num_new), max(seq_lens))
    ours = triton_attention.paged_attention(*args)
    ref = torch_ref.paged_attention(*args)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol_8bit(dtype),
                               rtol=tol_8bit(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_writes_rows_and_scales_as_torch_ref(fmt, dtype):
    """Rotated k and v quantized per row: same scales, values within one step of the format
    (the CPU interpreter converts some fp32 values to FP8 wrongly); a row of zeros, a NaN and a
    negative slot as torch_ref has them. Partial rotary (the pass-through dims count for the
    row's amax)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens, rotary_dim = 4, 2, 16, 5, 12
    q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    k = (torch.randn(tokens, kv_heads, dim, generator=g) * 4).to(dtype)
    v = (torch.randn(tokens, kv_heads, dim, generator=g) * 4).to(dtype)
    k[0, 0, rotary_dim + 1] = 50.0  # a pass-through dim sets this row's scale
    v[1, 0] = 0.0
    v[3, 1, 2] = float("nan")
    positions, slots = torch.tensor([0, 3, 9, 2, 6]), torch.tensor([5, 0, -1, 2, 7])
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(16).float()[:, None] * inv
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    ref_k, ref_v = caches(fmt, 2, 4, kv_heads, dim, dtype, poison=False, device="cpu")
    ref_q = torch_ref.rotary_store_kv(q, k, v, positions, cos_sin, ref_k, ref_v, slots)
    k_cache, v_cache = caches(fmt, 2, 4, kv_heads, dim, dtype, poison=False)
    ours_q = kv_store.rotary_store_kv(*(t.to(DEVICE) for t in (q, k, v, positions, cos_sin)),
                                      k_cache, v_cache, slots.to(DEVICE))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours_q.cpu(), ref_q, atol=tol, rtol=tol)
    for ours, ref in ((k_cache.cpu(), ref_k), (v_cache.cpu(), ref_v)):
        if ours.shape[-1] == dim:  # fp8_v's K: the activation dtype
            torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
            continue
        raw, ref_raw = ours.view(torch.uint8), ref.view(torch.uint8)
        scales = raw[..., dim:].contiguous().view(torch.float32)
        ref_scales = ref_raw[..., dim:].contiguous().view(torch.float32)
        # (bf16: the rotated k rounds to bf16 first, which the interpreter may round otherwise)
        torch.testing.assert_close(scales, ref_scales, atol=0,
                                   rtol=1e-6 if dtype == torch.float32 else 1e-2)
        values, ref_values = dequantize_rows(ours), dequantize_rows(ref)
        step = ref_scales * (1.0 if ours.dtype == INT8 else 32.0)  # one code; e4m3 at 448: 32
        step = step * (1.0 if dtype == torch.float32 else 1.05)
        off = (values - ref_values).abs() > step + 1e-6
        assert off.sum() <= (0 if DEVICE == "cuda" else values.numel() // 50)
    assert float(dequantize_rows(v_cache.cpu()).view(-1, kv_heads, dim)[0, 0].abs().max()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch, seq_len", [(1, 8192), (64, 1024)])
def test_row_scaled_decode_at_real_shapes(fmt, batch, seq_len):
    """Llama-3.1-8B's attention shape (32 heads, 8 KV heads, 128 dims, pages of 16)."""
    q, k_cache, v_cache, table, cu, lens = make_case(fmt, [seq_len] * batch, [1] * batch, 32, 8,
                                                     128, 16, torch.bfloat16, seed=7)
    args = (q, k_cache, v_cache, table, cu, lens, 128 ** -0.5, 1, seq_len)
    torch.testing.assert_close(triton_attention.paged_attention(*args).float(),
                               torch_ref.paged_attention(*args).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_mla_rows_with_their_scale_decode_and_sparse_as_torch_ref(dtype):
    """MLA latent rows [latent | rope] with their own scale, then 12 bytes of padding and an
    index key's columns (a column view, as the layer passes it): the Triton decode and sparse
    kernels against torch_ref, and torch_ref against the unquantized rows."""
    from frugal.ops.triton.dsa import sparse_mla_attention
    from frugal.ops.triton.mla_decode import mla_decode

    g = torch.Generator().manual_seed(8)
    lat, rope, heads, page_size, pages = 32, 16, 4, 16, 12
    width = lat + rope
    rows = torch.zeros(pages, page_size, 1, width + 16 + 8, dtype=torch.uint8).view(dtype)
    cache = rows[..., :width + SCALE_BYTES]
    plain = torch.zeros(pages, page_size, 1, width)
    latent = torch.randn(pages * page_size, 1, width, generator=g) * 2
    slots = torch.arange(pages * page_size)
    torch_ref.store_latent(latent, cache, slots)
    torch_ref.store_latent(latent, plain, slots)
    table = torch.randperm(pages, generator=g)[:9].view(3, 3).int()
    seq_lens = torch.tensor([20, 9, 48], dtype=torch.int32)
    q = torch.randn(3, heads, width, generator=g)
    cu = torch.arange(4, dtype=torch.int32)
    args = (table, cu, seq_lens, width ** -0.5, 1, 48, lat, 3)
    ref = torch_ref.mla_attention(q, cache, *args)
    exact = torch_ref.mla_attention(q, plain, *args)
    assert 0 < (ref - exact).abs().max() < (0.05 if dtype == INT8 else 0.2)
    dev = [t.to(DEVICE) for t in (q, rows, table, seq_lens)]
    got = mla_decode(dev[0], dev[1][..., :width + SCALE_BYTES], dev[2], dev[3], width ** -0.5,
                     48, lat)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    selection = torch.tensor([[0, 5, 19, -1], [8, 2, -1, -1], [47, 0, 30, 12]],
                             dtype=torch.int32)
    ref = torch_ref.sparse_mla_attention(q, cache, table, cu, selection, 0.2, lat)
    got = sparse_mla_attention(dev[0], dev[1][..., :width + SCALE_BYTES], dev[2],
                               cu.to(DEVICE), selection.to(DEVICE), 0.2, lat)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["bf16", "static", "fp8_rows", "int8_rows"])
def test_triton_latent_and_index_key_store_as_torch_ref(mode):
    """The Triton latent store (no host mask: a negative slot stores nothing) and the FP8 index
    key store write what torch_ref writes, into a column view of wider rows; NaN as 0. (The CPU
    interpreter converts a few fp32 values to FP8 wrongly: a few may be a step further off.)"""
    from frugal.ops.triton.latent_store import store_index_key, store_latent

    g = torch.Generator().manual_seed(11)
    width, dim, tokens = 24, 16, 6
    dtype = {"bf16": torch.bfloat16, "int8_rows": INT8}.get(mode, FP8)
    own = mode.endswith("rows")
    lat_bytes = width + (16 if own else 0)
    row = lat_bytes + (dim + 16 if dtype.itemsize == 1 else dim)
    latent = torch.randn(tokens, 1, width, generator=g) * 3
    latent[2, 0, 5] = float("nan")
    key = torch.randn(tokens, dim, generator=g)
    slots = torch.tensor([3, 0, 9, -1, 12, 7])
    scales = None if mode != "static" else torch.tensor([[0.05], [0.05]])
    caches = []
    for store_l, store_k, device in ((torch_ref.store_latent, torch_ref.store_index_key, "cpu"),
                                     (store_latent, store_index_key, DEVICE)):
        rows = torch.zeros(4, 4, 1, row, dtype=torch.uint8, device=device)
        rows = rows if dtype == torch.bfloat16 else rows.view(dtype)
        if dtype == torch.bfloat16:
            rows = torch.zeros(4, 4, 1, row, dtype=dtype, device=device)
        store_l(latent.to(device), rows[..., :width + (4 if own else 0)], slots.to(device),
                None if scales is None else scales.to(device))
        if dtype.itemsize == 1:
            index = rows[..., lat_bytes:].view(FP8)
            store_k(key.to(device), index, slots.to(device))
        caches.append(rows.cpu())
    ref, ours = caches
    if dtype != torch.bfloat16:  # the NaN stored as 0 (slot 9: token 2's)
        nan_at = ours[2, 1, 0, 5].float() if not own else dequantize_rows(
            ours[2, 1, 0, :width + 4])[5]
        assert float(nan_at) == 0.0
    if dtype == torch.bfloat16:  # (the interpreter may round to bf16 otherwise)
        torch.testing.assert_close(ours, ref, atol=0, rtol=0 if DEVICE == "cuda" else 1e-2,
                                   equal_nan=True)  # (a bf16 cache keeps a NaN, as torch_ref)
        return
    raw, ref_raw = ours.view(torch.uint8), ref.view(torch.uint8)
    if own:  # the latent's scale, bit for bit, and the padding untouched
        assert torch.equal(raw[..., width:lat_bytes], ref_raw[..., width:lat_bytes])
    lat = ours[..., :width].float() if not own else dequantize_rows(ours[..., :width + 4])
    ref_lat = ref[..., :width].float() if not own else dequantize_rows(ref[..., :width + 4])
    step = ref_lat.abs().amax(-1, keepdim=True) / (127 if dtype == INT8 else 8) + 1e-6
    off = (lat - ref_lat).abs() > step
    assert off.sum() <= (0 if DEVICE == "cuda" else lat.numel() // 50)
    keys = dequantize_rows(ours[..., lat_bytes:lat_bytes + dim + 4].view(FP8))
    ref_keys = dequantize_rows(ref[..., lat_bytes:lat_bytes + dim + 4].view(FP8))
    off = (keys - ref_keys).abs() > ref_keys.abs().amax(-1, keepdim=True) / 8 + 1e-6
    assert off.sum() <= (0 if DEVICE == "cuda" else keys.numel() // 50)
    assert torch.equal(raw[..., lat_bytes + dim:], ref_raw[..., lat_bytes + dim:])  # scale, pad
    assert not raw.view(16, -1)[[1, 2, 4, 5, 6, 8, 10, 11, 13, 14, 15]].any()  # unwritten
