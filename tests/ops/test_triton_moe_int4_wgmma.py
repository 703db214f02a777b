"""INT4 experts on Hopper's warpgroup MMA (ops.triton.moe_int4_wgmma): the stacked layout on any
machine, the kernel on the GPU against torch_ref."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.experts import quantize_experts
from tests.ops import launches

wg = pytest.importorskip("frugal.ops.triton.moe_int4_wgmma")
tiles_mod = pytest.importorskip("frugal.ops.triton.moe_int4_tiles")
lin = pytest.importorskip("frugal.ops.triton.int4_linear")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_experts(torch.randn(e, n, k, generator=g) * k ** -0.5, "int4")


def test_repack_experts_stacks_each_experts_tiles():
    """Expert e's words and scales are int4_linear.repack's of expert e (rows padded to blocks
    of 64, inputs to tiles of 128); symmetric codes: centered, the scales alone."""
    w = experts(3, 96, 160, 0)
    t = tiles_mod.repack_experts(w, torch.float32)
    assert t.shape == (3, 96, 160) and t.padded_k == 256 and t.group == 32 and t.centered
    assert t.words.shape == (3, 2, 2, 64, 16) and t.params.shape == (3, 8, 96)
    # (the kernel's offsets of an expert: rows in blocks of 64, Kp / 8 words each; its 16-bit
    # scales one int16 each)
    b = tiles_mod.repack_experts(w, torch.bfloat16)
    assert b.words.stride(0) == 2 * 256 * 8 and lin.kernel_params(b).stride(0) == 8 * 96
    for e in range(3):
        one = lin.repack(w.expert(e), torch.float32)
        assert torch.equal(t.words[e], one.words) and torch.equal(t.params[e], one.params)


def test_repack_experts_keeps_pairs_unless_every_expert_is_centered(monkeypatch):
    """One expert not centered (its mins not -8 · scale in the activations' dtype): every
    expert's (scale, min) pairs, the centered ones' mins written out."""
    w = experts(3, 96, 160, 0)
    repack = lin.repack
    monkeypatch.setattr(tiles_mod, "repack", lambda q, dtype: (
        lin.uncentered(repack(q, dtype)) if torch.equal(q.packed, w.expert(1).packed)
        else repack(q, dtype)))
    t = tiles_mod.repack_experts(w, torch.float32)
    assert not t.centered and t.params.shape == (3, 8, 96, 2)
    for e in range(3):
        assert torch.equal(t.params[e], lin.uncentered(repack(w.expert(e), torch.float32)).params)


def test_pack_experts_only_on_hopper_unless_turned_off(monkeypatch):
    """Off a Hopper GPU, turned off (FRUGAL_INT4_MOE_WGMMA=0), or FP8 experts: the experts
    come back as they were."""
    w = experts(2, 64, 128, 1)
    monkeypatch.delenv("FRUGAL_INT4_MOE_WGMMA", raising=False)
    assert tiles_mod.pack_experts(w, torch.bfloat16) is w  # (on the CPU)
    monkeypatch.setattr(tiles_mod, "_hopper", lambda device: True)
    assert isinstance(tiles_mod.pack_experts(w, torch.bfloat16), tiles_mod.Int4ExpertTiles)
    fp8 = quantize_experts(torch.randn(2, 64, 128), "fp8")
    assert tiles_mod.pack_experts(fp8, torch.bfloat16) is fp8
    monkeypatch.setenv("FRUGAL_INT4_MOE_WGMMA", "0")
    assert tiles_mod.pack_experts(w, torch.bfloat16) is w


def test_dequantize_expert_tiles():
    """Experts first.. of the stacked tiles, dequantized in one launch, are each expert's own
    dequantized weight."""
    w = experts(5, 96, 160, 2)
    t = tiles_mod.repack_experts(w.to(DEVICE), torch.float32)
    out = tiles_mod.dequantize(t, 1, torch.empty(3, 96, 160, device=DEVICE)).cpu()
    for i in range(3):
        torch.testing.assert_close(out[i], w.expert(1 + i).dequantize(), atol=1e-6, rtol=1e-6)


def test_fused_moe_dequantizes_expert_tiles_at_prompt_sizes():
    """Past moe_dense.DENSE_SLOTS slots an expert, repacked experts are dequantized from their
    tiles and multiplied as float experts: torch_ref's result."""
    from frugal.ops.triton import moe

    g = torch.Generator().manual_seed(3)
    num, top_k, hidden, inter, tokens = 2, 2, 64, 32, 130
    gate_up, down = experts(num, 2 * inter, hidden, 4), experts(num, hidden, inter, 5)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.rand(tokens, num, generator=g).topk(top_k, dim=-1)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    tiles = [tiles_mod.repack_experts(w.to(DEVICE), torch.float32) for w in (gate_up, down)]
    got = moe.fused_moe(x.to(DEVICE), *tiles, weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_split_for_few_programs():
    """Splits double while the busy programs stay within 512 and each keeps 4 tiles: Qwen3-30B-A3B
    at one token, gate_up 12 output blocks x 8 experts over 16 tiles (4 splits), down 32 x 8
    over 6 (none); at 16 tokens, none."""
    assert wg.split_for(12 * 8, 16) == 4 and wg.split_for(32 * 8, 6) == 1
    assert wg.split_for(12 * 128, 16) == 1 and wg.split_for(3 * 4, 8) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,block_m,hidden,per_slot,pairs", [
    (1, 16, 160, True, False), (5, 16, 160, True, False), (16, 16, 160, True, False),
    (1, 16, 1024, True, False), (1, 16, 160, False, False), (16, 16, 160, False, False),
    (24, 32, 160, False, False), (40, 16, 160, False, False), (80, 64, 160, False, False),
    (80, 32, 160, False, False), (2, 32, 1024, False, False), (5, 16, 160, True, True),
    (24, 32, 160, False, True)])
def test_moe_int4_wgmma_gpu(tokens, block_m, hidden, per_slot, pairs, monkeypatch):
    """fused_moe on the kernel: up to 64 slots a block per slot (per_slot; else the GEMV's limit
    set to 0) and the sorted path's blocks of 16, 32 and 64 rows; 160 outputs of 160 inputs
    (rows padded to blocks of 64, the up half starting inside one, a partial block of 64
    outputs, K padded to 256), padding rows in every block; gate_up over 1024 inputs at 1-2
    tokens split in two (reduced by the last program), against torch_ref in fp32; at an odd
    count of tokens with a residual. A block a slot, down sums each token's slots itself
    (TOP_K). Centered (scales alone), and as (scale, min) pairs (int4_linear.uncentered: what
    experts whose mins are not all -8 · scale keep)."""
    from frugal.ops.triton import moe, moe_combine, moe_gemv, split_k

    monkeypatch.setenv("FRUGAL_INT4_MOE_WGMMA", "1")
    if not per_slot:
        monkeypatch.setattr(moe_gemv, "MAX_SLOTS", 0)
    monkeypatch.setattr(moe, "rows_per_block", lambda *args: block_m)
    num, top_k, inter = 16, 4, 160
    gate_up, down = experts(num, 2 * inter, hidden, tokens), experts(num, hidden, inter, tokens + 1)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, ids = torch.rand(tokens, num, generator=g).topk(top_k, dim=-1)
    res = torch.randn(tokens, hidden, generator=g).bfloat16() if tokens % 2 else None
    ref = torch_ref.fused_moe(x.float(), gate_up, down, weights, ids,
                              residual=None if res is None else res.float())
    packed = [tiles_mod.pack_experts(w.to("cuda"), torch.bfloat16) for w in (gate_up, down)]
    assert all(isinstance(p, tiles_mod.Int4ExpertTiles) and p.centered for p in packed)
    if pairs:
        packed = [lin.uncentered(p) for p in packed]
    launched = launches.record(monkeypatch, wg, "_moe_int4_wgmma", "BLOCK_M", "GATED", "SPLIT_K",
                               "PER_SLOT", "TOP_K")
    got = moe.fused_moe(x.cuda(), *packed, weights.cuda(), ids.cuda(),
                        residual=None if res is None else res.cuda())
    split = 2 if hidden == 1024 else 1
    assert launched == [(block_m, True, split, per_slot, 0),
                        (block_m, False, 1, per_slot, top_k if per_slot else 0)]
    assert not split_k.counters(got.device).any()
    if per_slot:  # the sums down made: the combine launch's
        monkeypatch.setattr(moe_combine, "sums_tokens", lambda tokens, blocks: False)
        apart = moe.fused_moe(x.cuda(), *packed, weights.cuda(), ids.cuda(),
                              residual=None if res is None else res.cuda())
        assert launched[-1][-1] == 0 and torch.equal(got, apart)
    torch.testing.assert_close(got.float().cpu(), ref, atol=2e-2 * ref.abs().max().item(),
                               rtol=2e-2)
