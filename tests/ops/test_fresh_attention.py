"""Prompt attention reading the step's own keys and values as computed (paged_attention's fresh)
and the rotated k the store hands back for it: Triton against torch_ref for every cache format
(in the interpreter on CPU at tiny shapes), the same result as without over an unquantized cache,
and exact where a quantized cache holds nothing before the step."""

import pytest
import torch

from frugal.ops import torch_ref
from tests.ops.test_kv_row_scales import caches as row_caches
from tests.ops.test_kv_row_scales import make_case as row_case
from tests.ops.test_triton_attention import DEVICE, FP8, TOL, fp8_scales, make_case, tol_8bit

triton_attention = pytest.importorskip("frugal.ops.triton.attention")
kv_store = pytest.importorskip("frugal.ops.triton.kv_store")
FORMATS = ["auto", "fp8_e4m3", "fp8", "int8", "fp8_v"]  # (fp8, int8: per token and head)
CASES = [  # (seq_lens, num_new, heads, kv_heads, head_dim, page_size, num_decodes)
    # a decode, a prompt after 8 cached tokens, one with none, one after 7; the decode kernel
    ([37, 20, 9, 12], [1, 12, 9, 5], 6, 2, 16, 4, 1),
    # the same through the prompt kernel only, its decode too (as a captured step runs them)
    ([37, 20, 9, 12], [1, 12, 9, 5], 6, 2, 16, 4, 0),
    # a prompt over several key blocks, a decode between prompts, 110 cached then 40 new
    ([70, 5, 150], [70, 1, 40], 4, 4, 32, 16, 0),
    # 16-token blocks of a group of 3 (padded to 4) after 30 cached, then a fresh prompt
    ([50, 9, 24], [20, 1, 24], 6, 2, 16, 4, 0),
]


def case(fmt, index, dtype):
    """(paged_attention's arguments, kv_scales, num_decodes, num_kv_heads, head_dim) of CASES[
    index] over a poisoned pool of the format holding each request's whole context."""
    seq_lens, num_new, heads, kv_heads, dim, page, decodes = CASES[index]
    scales = fp8_scales(kv_heads, seed=index) if fmt == "fp8_e4m3" else None
    if fmt in ("auto", "fp8_e4m3"):
        tensors = make_case(seq_lens, num_new, heads, kv_heads, dim, page, dtype, seed=index,
                            scales=scales)
    else:
        tensors = row_case(fmt, seq_lens, num_new, heads, kv_heads, dim, page, dtype, index)
    args = (*tensors, dim ** -0.5, max(num_new), max(seq_lens))
    return args, None if scales is None else scales.to(DEVICE), decodes, kv_heads, dim


def fresh_kv(num_tokens, kv_heads, dim, dtype, seed):
    """Keys and values unlike the cache's (|x| ~ 1 against its ~3): reading them shows."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(num_tokens, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
                 for _ in range(2))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_fresh_attention_matches_torch_ref(index, dtype, fmt):
    args, scales, decodes, kv_heads, dim = case(fmt, index, dtype)
    fresh = fresh_kv(args[0].shape[0], kv_heads, dim, dtype, seed=index)
    ref = torch_ref.paged_attention(*args, scales, decodes, fresh)
    ours = triton_attention.paged_attention(*args, scales, decodes, fresh)
    assert torch.isfinite(ours).all()
    tol = TOL[dtype] if fmt == "auto" else tol_8bit(dtype)
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    # (fresh was read: every prompt row moved, every decode row stayed)
    seq_lens, num_new = CASES[index][:2]
    cu = [0, *torch.tensor(num_new).cumsum(0).tolist()]
    cached = torch_ref.paged_attention(*args, scales, decodes)
    for b, n in enumerate(num_new):
        moved = (ref[cu[b]:cu[b + 1]].float() - cached[cu[b]:cu[b + 1]].float()).abs()
        if n > 1:
            assert moved.max() > 0.1 and (moved.amax(dim=(1, 2)) > 0).all()
        else:
            assert moved.max() == 0


def stored(k_cache, v_cache, table, cu, lens):
    """The new tokens' K and V as an unquantized cache holds them, [num_tokens, heads, dim]."""
    page_size = k_cache.shape[1]
    slots = [int(table[b, p // page_size]) * page_size + p % page_size
             for b in range(len(lens)) for p in range(int(lens[b]) - int(cu[b + 1] - cu[b]),
                                                      int(lens[b]))]
    slots = torch.tensor(slots, device=k_cache.device)
    return tuple(c.view(-1, *c.shape[2:])[slots] for c in (k_cache, v_cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_fresh_over_an_unquantized_cache_changes_nothing(index, dtype):
    """Fresh K/V equal to what the cache holds: torch_ref's result bit for bit, Triton's within
    float error (its key blocks split elsewhere)."""
    args, _, decodes, _, _ = case("auto", index, dtype)
    fresh = stored(*args[1:3], *args[3:6])
    plain = torch_ref.paged_attention(*args, None, decodes)
    assert torch.equal(torch_ref.paged_attention(*args, None, decodes, fresh), plain)
    plain = triton_attention.paged_attention(*args, None, decodes)
    ours = triton_attention.paged_attention(*args, None, decodes, fresh)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # (bf16: one rounding step)
    torch.testing.assert_close(ours.float(), plain.float(), atol=tol, rtol=tol)


def quantized_prompts(fmt, num_new, heads, kv_heads, dim, page_size, seed):
    """Prompts with nothing cached before them, their fp32 K/V stored into a pool of the format
    (static FP8: with scales) and into an fp32 one: (q, quantized (k_cache, v_cache), fp32
    caches, page table, cu_seqlens, seq_lens, kv_scales, the K/V themselves)."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(num_new)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g) * 3 for _ in range(2))
    q = torch.randn(tokens, heads, dim, generator=g)
    pages = [-(-n // page_size) for n in num_new]
    num_pages, width = sum(pages), max(pages)
    shape = (num_pages, page_size, kv_heads, dim)
    scales = None
    if fmt == "fp8_e4m3":
        scales = fp8_scales(kv_heads, seed)
        quantized = (torch.zeros(shape, dtype=FP8), torch.zeros(num_pages, kv_heads, dim,
                                                                page_size, dtype=FP8))
    else:
        quantized = row_caches(fmt, num_pages, page_size, kv_heads, dim, torch.float32,
                               device="cpu")
    exact = (torch.zeros(shape), torch.zeros(shape))
    table, slots, first = [], [], 0
    for n, p in zip(num_new, pages):
        table.append(list(range(first, first + p)) + [0] * (width - p))
        slots += range(first * page_size, first * page_size + n)
        first += p
    for k_cache, v_cache in (quantized, exact):
        torch_ref.store_kv(k, v, k_cache, v_cache, torch.tensor(slots),
                           scales if k_cache is quantized[0] else None)
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (q, *quantized, *exact, torch.tensor(table, dtype=torch.int32),
                                  cu, torch.tensor(num_new, dtype=torch.int32))]
    return (*dev, None if scales is None else scales.to(DEVICE), k.to(DEVICE), v.to(DEVICE))


@pytest.mark.parametrize("fmt", FORMATS[1:])
def test_fresh_prompts_over_a_quantized_cache_are_exact(fmt):
    """Prompts with nothing cached before them read only their own K/V: with fresh, fp32
    attention over the unquantized K/V up to float error (both backends); through the cache,
    off by the format's rounding."""
    num_new, dim = [9, 24, 3], 16
    q, k_cache, v_cache, k_exact, v_exact, table, cu, lens, scales, k, v = quantized_prompts(
        fmt, num_new, 6, 2, dim, 4, seed=len(fmt))
    layout = (table, cu, lens, dim ** -0.5, max(num_new), max(num_new))
    exact = torch_ref.paged_attention(q, k_exact, v_exact, *layout)
    for impl in (torch_ref, triton_attention):
        cached = impl.paged_attention(q, k_cache, v_cache, *layout, scales)
        ours = impl.paged_attention(q, k_cache, v_cache, *layout, scales, 0, (k, v))
        err, err_cached = ((x - exact).abs().max().item() for x in (ours, cached))
        assert err < 1e-4 < err_cached / 10, (impl.__name__, err, err_cached)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "int8"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_store_kv_hands_back_the_rotated_k(qk_norm, fmt, dtype):
    """k_out: every token's rotated k (a negative slot's too) in q's dtype, Triton as torch_ref;
    over an unquantized cache exactly what the cache stores, over a quantized one the same
    (the unquantized values). Views of a fused qkv row, partial rotary (12 of 16 dims)."""
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, tokens, rotary_dim = 4, 2, 16, 5, 12
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = (x.reshape(tokens, -1, dim)
               for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    norm = None
    if qk_norm:
        norm = (torch.rand(dim, generator=g).add(0.5).to(dtype),
                torch.rand(dim, generator=g).add(0.5).to(dtype), 1e-6)
    positions, slots = torch.tensor([0, 7, 300, 5, 11]), torch.tensor([3, 0, -1, 9, 12])
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(512).float()[:, None] * inv
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    scales = fp8_scales(kv_heads, seed=2) if fmt == "fp8_e4m3" else None
    outs = []
    for impl, device in ((torch_ref, "cpu"), (kv_store, DEVICE)):
        if fmt == "auto":
            k_cache, v_cache = (torch.zeros(4, 4, kv_heads, dim, dtype=dtype, device=device)
                                for _ in range(2))
        elif fmt == "fp8_e4m3":
            k_cache = torch.zeros(4, 4, kv_heads, dim, dtype=FP8, device=device)
            v_cache = torch.zeros(4, kv_heads, dim, 4, dtype=FP8, device=device)
        else:
            k_cache, v_cache = row_caches(fmt, 4, 4, kv_heads, dim, dtype, device=device)
        k_out = torch.full((tokens, kv_heads, dim), float("nan"), dtype=dtype, device=device)
        inputs = [x.to(device) for x in (q, k, v, positions, cos_sin)]  # (CPU: the views)
        impl.rotary_store_kv(*inputs, k_cache, v_cache, slots.to(device),
                             None if scales is None else scales.to(device),
                             norm and (norm[0].to(device), norm[1].to(device), norm[2]), k_out)
        outs.append(k_out.cpu())
        if fmt == "auto":
            kept = slots >= 0
            assert torch.equal(k_out[kept.to(device)],
                               k_cache.view(-1, kv_heads, dim)[slots[kept].to(device)])
    ref, ours = outs
    assert torch.isfinite(ours).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    if not qk_norm:  # the dims past rotary_dim are k's own
        assert torch.equal(ref[..., rotary_dim:], k[..., rotary_dim:])
    assert not torch.equal(ref[..., :rotary_dim], k[..., :rotary_dim])  # (rotated)


@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3", "int8"])
def test_a_padded_prompt_step_with_fresh_kv_leaves_its_padding_zero(fmt):
    """A step as worker.prompt_graphs pads it (token rows in no request, NaN in q and in the
    fresh K/V; requests of no tokens and seq_len 0; every request through the prompt kernel):
    its real rows are the unpadded step's, its padding rows zeros."""
    args, scales, _, kv_heads, dim = case(fmt, 0, torch.bfloat16)
    q, k_cache, v_cache, table, cu, lens, scale, _, max_len = args
    fresh = fresh_kv(q.shape[0], kv_heads, dim, torch.bfloat16, seed=1)
    real = torch_ref.paged_attention(*args, scales, 1, fresh)
    tokens, requests = 48, 6
    pad = tokens - q.shape[0]
    q_pad, k_pad, v_pad = (torch.cat([x, torch.full((pad, *x.shape[1:]), float("nan"),
                                                    dtype=x.dtype, device=x.device)])
                           for x in (q, *fresh))
    extra = requests - len(lens)
    cu_pad = torch.cat([cu, cu[-1:].repeat(extra)])
    lens_pad = torch.cat([lens, lens.new_zeros(extra)])
    table_pad = torch.cat([table, table.new_zeros(extra, table.shape[1])])
    for impl in (torch_ref, triton_attention):
        out = impl.paged_attention(q_pad, k_cache, v_cache, table_pad, cu_pad, lens_pad, scale,
                                   tokens, max_len, scales, 0, (k_pad, v_pad))
        torch.testing.assert_close(out[:q.shape[0]].float(), real.float(),
                                   atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
        assert bool((out[q.shape[0]:] == 0).all())
