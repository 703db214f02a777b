"""The routing kernel (ops.triton.moe_route) against torch_ref.route_experts on fresh random
logits: softmax top-k (Qwen3-MoE, DeepSeek-V2-Lite's 6 of 64), sigmoid with a correction bias
over groups (DeepSeek-V3), without groups (Kimi K2's 384 experts, GLM-4.5), renormalized or
not, scaled."""

import pytest
import torch

from frugal.ops import torch_ref

tri = pytest.importorskip("frugal.ops.triton.moe_route")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {  # experts, top_k, scoring, renormalize, n_group, topk_group, scaling, bias
    "qwen3": (128, 8, "softmax", True, 1, 1, 1.0, False),
    "qwen3-no-renorm": (64, 4, "softmax", False, 1, 1, 1.0, False),
    "deepseek-v3": (256, 8, "sigmoid", True, 8, 4, 2.5, True),
    "kimi-k2": (384, 8, "sigmoid", True, 1, 1, 2.827, True),
    "glm-4.5": (160, 8, "sigmoid", True, 1, 1, 1.0, True),
    "sigmoid-no-bias": (32, 2, "sigmoid", False, 1, 1, 1.0, False),
    "deepseek-v2-lite": (64, 6, "softmax", False, 1, 1, 1.0, False),  # top_k not a power of 2
    "sigmoid-top6": (96, 6, "sigmoid", True, 1, 1, 2.5, True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (5, 64), (2, 600), (40, 600)])
def test_route_experts(case, tokens, hidden):
    """hidden 600 at a decode-sized step: the logits in 3 slices (at 40 tokens in 5 of the
    32 × 32 tiles), summed by the route kernel."""
    experts, top_k, scoring, renorm, n_group, topk_group, scaling, bias = CASES[case]
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    # logits ~ N(0, 1): no sigmoid saturated to a tie at 1.0
    x = torch.randn(tokens, hidden, generator=g) / hidden ** 0.5
    router = torch.randn(experts, hidden, generator=g)
    correction = torch.rand(experts, generator=g) * 0.1 if bias else None
    args = (top_k, scoring, renorm, n_group, topk_group, scaling)
    want_w, want_ids = torch_ref.route_experts(x, router, correction, *args)
    got_w, got_ids = tri.route_experts(x.to(DEVICE), router.to(DEVICE),
                                       None if correction is None else correction.to(DEVICE),
                                       *args)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    # the same experts (in any order), and each one's weight
    order_got, order_want = got_ids.cpu().argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got_ids.cpu().gather(1, order_got), want_ids.gather(1, order_want))
    torch.testing.assert_close(got_w.cpu().gather(1, order_got), want_w.gather(1, order_want),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,hidden,splits,slices", [
    (1, 128, 300, 1, 1), (1, 128, 600, 8, 3), (16, 160, 64, 8, 1), (17, 24, 80, 1, 1),
    (70, 384, 144, 1, 1), (3, 384, 1100, 2, 2), (64, 128, 600, 8, 5), (129, 64, 200, 8, 4)])
def test_router_logits(dtype, tokens, experts, hidden, splits, slices):
    """The router logits in fp32 from x and the router in their own dtype, as partial sums over
    slices of hidden: tokens on both sides of the tile sizes (16, 128), experts and hidden sizes
    that are no multiple of the tiles, slices of whole K tiles (the last one short)."""
    g = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    router = torch.randn(experts, hidden, generator=g).to(dtype)
    got = tri.router_logits(x.to(DEVICE), router.to(DEVICE), splits)
    assert got.dtype == torch.float32 and got.shape == (slices, tokens, experts)
    torch.testing.assert_close(got.sum(0).cpu(), x.float() @ router.float().t(), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("case", ["qwen3", "deepseek-v3", "kimi-k2", "deepseek-v2-lite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden", [(1, 96), (5, 600), (16, 64), (17, 64)])
def test_norm_route_experts(case, dtype, tokens, hidden, monkeypatch):
    """The MoE layer's norm, router logits and routing: up to 16 tokens one launch (its slices
    of 64 inputs, 600 in 8 slices the last short), more through rms_norm and route_experts; x
    as torch_ref's rms_norm (bf16: within its two roundings), the experts and weights torch_ref
    routes that x to, and the counters left zero."""
    from frugal.ops.triton import moe_route_normed, split_k

    experts, top_k, scoring, renorm, n_group, topk_group, scaling, bias = CASES[case]
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    h = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    norm = (1 + torch.rand(hidden, generator=g)).to(dtype)
    # (logits ~ N(0, 2): no softmax probability underflowing to a tie at 0)
    router = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype)
    correction = torch.rand(experts, generator=g) * 0.1 if bias else None
    args = (top_k, scoring, renorm, n_group, topk_group, scaling)
    apart = []
    monkeypatch.setattr(moe_route_normed, "rms_norm",
                        lambda *a: apart.append(1) or tri_norm(*a))
    x, got_w, got_ids = moe_route_normed.norm_route_experts(
        h.to(DEVICE), norm.to(DEVICE), 1e-6, router.to(DEVICE),
        None if correction is None else correction.to(DEVICE), *args)
    # (17 tokens, or a router past ROUTER_READS: the three launches)
    assert apart == ([1] if tokens > 16 or tokens * experts * hidden > (1 << 22) else [])
    want_x = torch_ref.rms_norm(h, norm, 1e-6)
    assert x.dtype == dtype and x.shape == h.shape
    # (bf16: the normalized value and its product with the weight each rounded, an ulp apart
    # at most where the squares were summed in another order)
    torch.testing.assert_close(x.cpu(), want_x, atol=0,
                               rtol=1e-5 if dtype == torch.float32 else 2 ** -6)
    want_w, want_ids = torch_ref.route_experts(x.cpu(), router, correction, *args)
    order_got, order_want = got_ids.cpu().argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got_ids.cpu().gather(1, order_got), want_ids.gather(1, order_want))
    torch.testing.assert_close(got_w.cpu().gather(1, order_got), want_w.gather(1, order_want),
                               rtol=1e-5, atol=1e-6)
    assert not split_k.counters(x.device).any()


def tri_norm(*args):
    from frugal.ops.triton.elementwise import rms_norm

    return rms_norm(*args)


@pytest.mark.parametrize("case", ["qwen3", "kimi-k2"])
def test_norm_route_experts_wide_router(case, monkeypatch):
    """Two tokens of 8192: Qwen3's 128 experts in one launch, Kimi K2's 384 past ROUTER_READS
    in three; either way as torch_ref routes."""
    test_norm_route_experts(case, torch.bfloat16, 2, 8192, monkeypatch)



@pytest.mark.parametrize("case, shared", [("kimi-k2", 1), ("deepseek-v2-lite", 2),
                                          ("deepseek-v3", 1), ("glm-4.5", 1)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_shared_experts_routed_after_the_routed_ones(case, shared, tokens):
    """shared > 0 (layers.moe's fused shared experts): every token's routed choice as without
    them, then experts E .. E + shared - 1 at weight 1.0, from the route kernel, from the
    one-launch norm + route (1 token; 17 through the three launches) and from torch_ref;
    GLM-4.5's 160 experts in 1 group and DeepSeek-V3's 256 in 8 take the kernel, as a
    grouped count that is no power of two would take torch_ref's ops."""
    from frugal.ops.triton import moe_route_normed

    experts, top_k, scoring, renorm, n_group, topk_group, scaling, bias = CASES[case]
    g = torch.Generator().manual_seed(tokens + shared)
    h = torch.randn(tokens, 96, generator=g)
    norm = 1 + torch.rand(96, generator=g)
    router = torch.randn(experts, 96, generator=g) / 96 ** 0.5
    correction = torch.rand(experts, generator=g) * 0.1 if bias else None
    args = (top_k, scoring, renorm, n_group, topk_group, scaling)
    x = torch_ref.rms_norm(h, norm, 1e-6)
    base_w, base_ids = torch_ref.route_experts(x, router, correction, *args)
    extra = torch.arange(experts, experts + shared).expand(tokens, shared)
    dev = [t.to(DEVICE) if t is not None else None for t in (h, norm, router, correction)]
    got = {"torch_ref": torch_ref.route_experts(x, router, correction, *args, shared),
           "kernel": tri.route_experts(x.to(DEVICE), dev[2], dev[3], *args, shared),
           "normed": moe_route_normed.norm_route_experts(dev[0], dev[1], 1e-6, dev[2], dev[3],
                                                         *args, shared)[1:]}
    for name, (w, ids) in got.items():
        w, ids = w.cpu(), ids.cpu()
        assert w.shape == ids.shape == (tokens, top_k + shared), name
        assert torch.equal(ids[:, top_k:], extra), name
        assert torch.equal(w[:, top_k:], torch.ones(tokens, shared)), name
        order, want_order = ids[:, :top_k].argsort(-1), base_ids.argsort(-1)
        assert torch.equal(ids[:, :top_k].gather(1, order), base_ids.gather(1, want_order)), name
        torch.testing.assert_close(w[:, :top_k].gather(1, order),
                                   base_w.gather(1, want_order), rtol=1e-5, atol=1e-6)
