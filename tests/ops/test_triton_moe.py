"""The fused MoE kernels (ops.triton.moe) against torch_ref.fused_moe on fresh random inputs:
float, FP8 block-scaled and INT4 experts; the sort by expert on its own."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.experts import Fp8Experts, Int4Experts, quantize_experts
from frugal.quant.fp8 import quantize_fp8
from tests.ops import launches

tri = pytest.importorskip("frugal.ops.triton.moe")
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def routed(tokens, experts, top_k, g):
    scores = torch.rand(tokens, experts, generator=g)
    weights, ids = scores.topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (5, 4, 3, 16),
                                                          (40, 16, 4, 64), (3, 64, 8, 16),
                                                          (300, 20, 4, 64), (200, 384, 8, 16),
                                                          (128, 128, 8, 16)])
def test_align(tokens, experts, top_k, block_m):
    """Up to 1,024 slots one program (128 tokens of top-8 the last), more three launches."""
    g = torch.Generator().manual_seed(tokens)
    _, ids = routed(tokens, experts, top_k, g)
    sorted_slots, block_expert, total = tri.align(ids.to(DEVICE), experts, block_m)
    sorted_slots, block_expert = sorted_slots.cpu(), block_expert.cpu()
    slots = tokens * top_k
    used = sorted_slots[: int(total)]
    assert sorted(used[used < slots].tolist()) == list(range(slots))  # every slot once
    assert bool((sorted_slots[int(total):] == slots).all())
    flat = ids.flatten()
    for b in range(int(total) // block_m):
        block = sorted_slots[b * block_m:(b + 1) * block_m]
        real = block[block < slots]
        assert len(real) > 0  # no block wholly padding below the total
        assert bool((flat[real.long()] == block_expert[b]).all())
    # (within an expert's run the slots come in any order: each GEMM row is stored at its slot)


def make(form, experts, inter, hidden, g):
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    if form == "float":
        return gate_up, down
    if form == "fp8_channel":
        def channel(w):
            parts = [quantize_fp8(e) for e in w]
            return Fp8Experts(torch.stack([p.data for p in parts]),
                              torch.stack([p.scales for p in parts]), None)
        return channel(gate_up), channel(down)
    scheme = "int4" if form == "int4" else "fp8"
    return quantize_experts(gate_up, scheme), quantize_experts(down, scheme)


@pytest.mark.parametrize("form", ["float", "fp8", "fp8_channel", "int4"])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 4, 2), (70, 8, 3)])
def test_fused_moe(form, tokens, experts, top_k):
    g = torch.Generator().manual_seed(tokens * 10 + experts)
    hidden, inter = 64, 32
    gate_up, down = make(form, experts, inter, hidden, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = routed(tokens, experts, top_k, g)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    got = tri.fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), weights.to(DEVICE),
                        ids.to(DEVICE))
    assert got.shape == ref.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_int4_experts_dequantize_as_kimi():
    """An INT4 expert's codes dequantize as (u - 8) · scale, groups of 32 (Kimi K2's format)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 16, 64, generator=g)
    q = quantize_experts(w, "int4")
    assert isinstance(q, Int4Experts) and q.group_size == 32 and q.shape == (2, 16, 64)
    e1 = q.expert(1)
    u = e1.codes().float().view(16, 2, 32)
    torch.testing.assert_close(e1.dequantize(), ((u - 8) * q.scales[1][:, :, None]).view(16, 64))
    assert (e1.dequantize() - w[1]).abs().max() <= q.scales[1].max() * 0.5 + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["float", "fp8", "int4"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_fused_moe_bf16_gpu(form, tokens):
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 32, 4, 512, 256
    gate_up, down = make(form, experts, inter, hidden, g)
    if form == "float":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, ids = routed(tokens, experts, top_k, g)
    ref = torch_ref.fused_moe(x.float(), gate_up.float() if form == "float" else gate_up,
                              down.float() if form == "float" else down, weights, ids)
    got = tri.fused_moe(x.cuda(), gate_up.to("cuda"), down.to("cuda"), weights.cuda(),
                        ids.cuda())
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2 * ref.abs().max().item(),
                               rtol=2e-2)


@pytest.mark.gpu
def test_fused_moe_expert_offsets_past_2_31_gpu():
    """72 experts of [2 x 4096, 4096]: the last ones start past 2**31 elements of the stack
    (Kimi K2's 384 x [2 x 2048, 7168] and GLM-5's 256 x [2 x 2048, 6144] do)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, tokens = 72, 4096, 4096, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16,
                          generator=g) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16,
                       generator=g) * 0.02
    assert gate_up[70].storage_offset() > 2**31
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.tensor([[71, 70], [0, 71]] * 4, device="cuda", dtype=torch.int32)
    weights = torch.full((tokens, 2), 0.5, device="cuda")
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    got = tri.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2 * ref.abs().max().item(),
                               rtol=2e-2)


TOP_K, HIDDEN, INTER, TOKENS = 2, 256, 128, 3  # a few tokens, several K steps, FP8 blocks


def few_tokens(form, experts, seed, same_experts=False):
    """(fused_moe's arguments on the device, torch_ref's result) for TOKENS tokens;
    same_experts: the first two tokens routed to the same experts."""
    g = torch.Generator().manual_seed(seed)
    gate_up, down = make(form, experts, INTER, HIDDEN, g)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    weights, ids = routed(TOKENS, experts, TOP_K, g)
    if same_experts:
        ids[1] = ids[0]
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    return [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)], ref


@pytest.mark.parametrize("form", ["float", "fp8", "fp8_channel", "int4"])
def test_small_batch_path_equals_the_sorted_path(form, monkeypatch):
    """A few tokens take moe_gemv (each slot reads its expert, no sort): the same result as the
    sorted grouped GEMMs and torch_ref, over several K steps and 128 × 128 FP8 scale blocks."""
    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    # two tokens on the same experts: each slot reads its own copy
    args, ref = few_tokens(form, 6, 11, same_experts=True)
    small = gemv.fused_moe_gemv(*args)
    monkeypatch.setattr(gemv, "MAX_SLOTS", 0)  # fused_moe takes the sorted path
    sorted_path = tri.fused_moe(*args)
    for got in (small, sorted_path):
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("form", ["float", "fp8", "int4"])
def test_tuned_configurations_compute_what_the_defaults_do(form, monkeypatch):
    """Tiles a tuning run may pick (ops.triton.moe_configs: narrow and wide N, K steps of 64 to
    256 (within one scale's inputs, or several whole INT4 groups of 32 / FP8 blocks of 128),
    several warps; INT4 with and without the next K step loaded ahead), given to both paths
    through the table, against torch_ref; an entry whose K tile would straddle a quantized
    scale's inputs is not taken."""
    from frugal.ops.triton import moe_configs

    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    args, ref = few_tokens(form, 4, 12)
    inter, hidden, slots = INTER, HIDDEN, TOKENS * TOP_K
    mode = {"float": 0, "fp8": 1, "int4": 2}[form]
    scale_k = {"float": 1, "fp8": 128, "int4": 32}[form]
    monkeypatch.setattr(moe_configs, "device_name", lambda device: "a tuned GPU")
    max_slots = gemv.MAX_SLOTS  # (each tile below takes both paths)
    # (the PREFETCH and STAGES each GEMV launch gets)
    launched = launches.record(monkeypatch, gemv, "_gemv", "PREFETCH", "STAGES")
    # (N tiles of 256 straddle FP8's blocks of 128 rows: scales on each block's partial sum)
    # (BLOCK_N, BLOCK_K, num_warps, PREFETCH, STAGES): K tiles past the down projection's 128
    # inputs too (STAGES: Triton pipelines the loop on a GPU; the interpreter runs it plainly)
    # (BLOCK_N, BLOCK_K, num_warps, num_stages[, BLOCK_M]): blocks of the entry's rows, or
    # rows_per_block's
    # (fp32 weights, 4 bytes each, pipelined in narrower N tiles: sm_90's 227 KB a block)
    fp32 = form == "float"
    for gemv_tile, sorted_tile in (((8, 64, 1, 1, 1), (32, 32, 4, 2, 32)),
                                   ((32 if fp32 else 64, 256, 8, 1, 3), (64, 64, 8, 3)),
                                   ((16, 64, 2, 2, 1), (32, 64, 4, 2, 64)),
                                   ((64 if fp32 else 256, 128, 4, 0, 3), (128, 32, 4, 4, 16))):
        table = {}
        for n, k in ((inter, hidden), (hidden, inter)):
            gemv_entry = dict(zip(moe_configs.FIELDS["gemv"] + tuple(moe_configs.OPTIONAL["gemv"]),
                                  gemv_tile))
            sorted_entry = dict(zip(moe_configs.FIELDS["sorted"]
                                    + tuple(moe_configs.OPTIONAL["sorted"]), sorted_tile))
            table[moe_configs.key("gemv", mode, n, k, slots)] = gemv_entry
            table[moe_configs.key("sorted", mode, n, k, slots)] = sorted_entry
        monkeypatch.setattr(moe_configs, "_table", lambda t=table: {"a tuned GPU": t})
        assert moe_configs.lookup(torch.device("cpu"), "gemv", mode, inter, hidden,
                                  slots, scale_k) is not None
        if mode != 0 and gemv_tile[1] == 64:  # (scales over 96 inputs: 64 would straddle)
            assert moe_configs.lookup(torch.device("cpu"), "gemv", mode, inter, hidden,
                                      slots, 96) is None
        for limit in (max_slots, 0):  # the small-batch path, then the sorted one
            monkeypatch.setattr(gemv, "MAX_SLOTS", limit)
            got = tri.fused_moe(*args)
            torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(),
                                       rtol=1e-4)
    # INT4 launches take the tiles' PREFETCH (two matrices each; then one stage), the other
    # forms none; every form the tiles' STAGES
    want = [(1, 1), (1, 1), (1, 1), (1, 1), (2, 1), (2, 1), (0, 3), (0, 3)] if mode == 2 else \
        [(0, 1), (0, 1), (0, 3), (0, 3), (0, 1), (0, 1), (0, 3), (0, 3)]
    assert launched == want, launched
    # a K tile the small-batch kernel cannot take (INT4: 16 inputs, not whole 32s) is ignored,
    # and so are a PREFETCH past 2 and STAGES past 4
    for tile in ((16, 16, 1, 0, 1), (16, 64, 1, 3, 1), (16, 64, 1, 0, 5)):
        table = {moe_configs.key("gemv", 2, inter, hidden, slots): dict(
            zip(moe_configs.FIELDS["gemv"] + tuple(moe_configs.OPTIONAL["gemv"]), tile))}
        monkeypatch.setattr(moe_configs, "_table", lambda t=table: {"a tuned GPU": t})
        assert moe_configs.lookup(torch.device("cpu"), "gemv", 2, inter, hidden, slots,
                                  16) is None


def test_sorted_blocks_hold_the_gate_up_entrys_rows(monkeypatch):
    """A sorted entry's BLOCK_M sets the alignment of both matrices (from gate_up's entry;
    without one, rows_per_block's 16 or 64); down's entry is taken only when tuned for the
    same rows (else its tiles would index the alignment's blocks wrongly: the default tiles
    run), with torch_ref's result every time."""
    from frugal.ops.triton import moe_configs

    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    args, ref = few_tokens("float", 4, 21)
    inter, hidden, slots = INTER, HIDDEN, TOKENS * TOP_K
    assert tri.rows_per_block(slots, 4) == 16
    monkeypatch.setattr(gemv, "MAX_SLOTS", 0)
    monkeypatch.setattr(moe_configs, "device_name", lambda device: "a tuned GPU")
    launched = launches.record(monkeypatch, tri, "_sorted_gemm", "BLOCK_M", "BLOCK_N")
    tile = {"BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    # (gate_up's BLOCK_M, down's): down's tiles are 16 wide, the defaults 32 (interpreter)
    # (None: an entry without BLOCK_M, tuned at rows_per_block's 16)
    for gate_up_rows, down_rows in ((32, 64), (None, 64), (32, 32), (32, None), (None, None)):
        gate_up = {**tile, "BLOCK_N": 32, **({"BLOCK_M": gate_up_rows} if gate_up_rows else {})}
        down = {**tile, "BLOCK_N": 16, **({"BLOCK_M": down_rows} if down_rows else {})}
        table = {moe_configs.key("sorted", 0, inter, hidden, slots): gate_up,
                 moe_configs.key("sorted", 0, hidden, inter, slots): down}
        monkeypatch.setattr(moe_configs, "_table", lambda t=table: {"a tuned GPU": t})
        got = tri.fused_moe(*args)
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(),
                                   rtol=1e-4)
    assert launched == [(32, 32), (32, 32), (16, 32), (16, 32), (32, 32), (32, 16),
                        (32, 32), (32, 32), (16, 32), (16, 16)], launched


def test_residual_joins_the_sum_on_both_paths(monkeypatch):
    """fused_moe(..., residual=h) = h + the experts' sum, rounded once: on the small-batch path
    and on the sorted one, against torch_ref's twin. (The residual joins after the experts,
    whatever their form: the quantized forms are the other tests'.)"""
    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    args, alone = few_tokens("float", 6, 13)
    residual = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    ref = alone + residual  # (fp32: one rounding either way)
    torch.testing.assert_close(torch_ref.fused_moe(*args, residual=residual.to(DEVICE)).cpu(),
                               ref, atol=1e-5, rtol=1e-5)
    for limit in (gemv.MAX_SLOTS, 0):
        monkeypatch.setattr(gemv, "MAX_SLOTS", limit)
        got = tri.fused_moe(*args, residual=residual.to(DEVICE))
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(),
                                   rtol=1e-4)


def test_int4_groups_of_16_take_the_sorted_path(monkeypatch):
    """The small-batch path sums INT4 products per 32 inputs: experts quantized in groups of 16
    go to the sorted path at any batch (moe_gemv.takes), with torch_ref's result."""
    from frugal.quant.experts import stack
    from frugal.quant.int4 import quantize_rtn

    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    g = torch.Generator().manual_seed(3)
    experts, inter, hidden = 4, 32, 64

    def int4(w):
        return stack([quantize_rtn(e, 16, symmetric=True) for e in w])

    gate_up = int4(torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5)
    down = int4(torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5)
    assert gate_up.group_size == 16 and not gemv.takes(gate_up)
    x = torch.randn(2, hidden, generator=g)
    weights, ids = routed(2, experts, 2, g)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    monkeypatch.setattr(gemv, "fused_moe_gemv", None)  # (taking it would fail)
    got = tri.fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), weights.to(DEVICE),
                        ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("form,residual", [("float", True), ("fp8", False), ("int4", True)])
def test_down_sums_each_tokens_slots_as_combine_does(form, residual, monkeypatch):
    """The small-batch down projection adds each token's slots itself (the last of them to
    finish, moe_combine.sum_token): the very sums of the combine launch it replaces, with or
    without the residual, and the counters it used zero again; where a counter per token and
    output block would not fit, the combine launch as before."""
    gemv = pytest.importorskip("frugal.ops.triton.moe_gemv")
    split_k = pytest.importorskip("frugal.ops.triton.split_k")
    args, _ = few_tokens(form, 6, 17)
    res = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    res = res if residual else None
    launched = launches.record(monkeypatch, gemv, "_gemv", "TOP_K", "RESIDUAL")
    fused = gemv.fused_moe_gemv(*args, residual=res)
    assert launched == [(0, False), (TOP_K, residual)]
    assert not split_k.counters(fused.device).any()
    combine_mod = pytest.importorskip("frugal.ops.triton.moe_combine")
    monkeypatch.setattr(combine_mod, "sums_tokens", lambda tokens, blocks: False)
    apart = gemv.fused_moe_gemv(*args, residual=res)
    assert launched[2:] == [(0, False), (0, False)]
    assert torch.equal(fused, apart)
