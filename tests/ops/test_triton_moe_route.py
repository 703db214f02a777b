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
@pytest.mark.parametrize("tokens", [1, 5])
def test_route_experts(case, tokens):
    experts, top_k, scoring, renorm, n_group, topk_group, scaling, bias = CASES[case]
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    hidden = 64
    x = torch.randn(tokens, hidden, generator=g)
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
@pytest.mark.parametrize("tokens,experts,hidden", [(1, 128, 300), (16, 160, 64), (17, 24, 80),
                                                   (70, 384, 144)])
def test_router_logits(dtype, tokens, experts, hidden):
    """The router logits in fp32 from x and the router in their own dtype: tokens on both sides
    of the decode tiles (16), experts and hidden sizes that are no multiple of the tiles."""
    g = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    router = torch.randn(experts, hidden, generator=g).to(dtype)
    got = tri.router_logits(x.to(DEVICE), router.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got.cpu(), x.float() @ router.float().t(), rtol=1e-5, atol=1e-4)
