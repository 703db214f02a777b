"""Mixture-of-experts models against transformers' own implementation: tiny random
Qwen3-MoE and GLM-4.5 configs written by transformers, loaded by frugal (per-expert checkpoint
tensors, shared experts, dense first layers, grouped sigmoid routing with a non-zero correction
bias, partial rotary), fp32 logits and greedy tokens compared."""

import pytest
import torch

from frugal import LLM
from frugal.ops import torch_ref
from tests.loader.test_hf_dir import save_random
from tests.models.test_llama_vs_hf import assert_greedy_matches, assert_logits_match, frugal_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False)
CASES = {
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1], head_dim=32),
    "qwen3-moe-no-renorm": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=6, norm_topk_prob=False),
    "glm4-moe": lambda: transformers.Glm4MoeConfig(
        **COMMON, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, head_dim=32, attention_bias=True),
    "glm4-moe-qk-norm": lambda: transformers.Glm4MoeConfig(
        **COMMON, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=2, n_group=1,
        topk_group=1, norm_topk_prob=False, use_qk_norm=True),
}


def write_model(case: str, path) -> torch.nn.Module:
    return save_random(CASES[case](), path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    ref_model = write_model(case, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    moe = llm.engine.model_config.moe
    assert moe is not None and len(moe.layers) >= 1
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = frugal_logits(llm, ids)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert_logits_match(ours, ref)
    assert_greedy_matches(llm, ref_model, ids, 8)


@pytest.mark.parametrize("case, spare", [("glm4-moe", 1), ("glm4-moe-qk-norm", 2)])
def test_shared_experts_join_the_routed_ones(case, spare, tmp_path):
    """By default the shared experts (1 and 2 of the routed size) become expert rows 8.. that
    every token takes at weight 1.0 (MoE.fuse_shared): the same logits as kept apart (and as
    transformers', above); shared_experts_fusion=False keeps them apart with no spare rows.
    Either way the experts' storage is just their rows, and fusing again changes nothing."""
    from frugal.layers.moe import MoE

    write_model(case, tmp_path)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB")
    fused = LLM(str(tmp_path), **kw)
    apart = LLM(str(tmp_path), **kw, shared_experts_fusion=False)
    for llm, want in ((fused, spare), (apart, 0)):
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoE)]
        assert layers
        for m in layers:
            assert m.fused == want and (m.shared_experts is None) == (want > 0)
            assert m.experts.num_experts == m.experts.gate_up_proj.shape[0] == 8 + want
            assert m.experts.down_proj.shape[0] == 8 + want
            for w in (m.experts.gate_up_proj, m.experts.down_proj):
                assert w.untyped_storage().nbytes() == w.numel() * w.element_size()
            assert m.fuse_shared() == (want > 0) and m.fused == want
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(frugal_logits(fused, ids), frugal_logits(apart, ids),
                               atol=1e-5, rtol=1e-5)


def test_an_expert_past_the_configs_is_refused(tmp_path):
    """A checkpoint tensor of expert 8 where the config has 8 experts is an error naming it, not
    a write into the row the shared expert will take."""
    from safetensors.torch import load_file, save_file

    write_model("glm4-moe", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    name = next(n for n in tensors if ".experts.7.down_proj" in n)
    tensors[name.replace(".experts.7.", ".experts.8.")] = tensors[name].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.8\..*expert 8 in checkpoint, model has 8"):
        LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB")


def test_grouped_routing_keeps_to_the_best_groups():
    """Sigmoid routing with groups: only experts of the topk_group best groups (by the sum of
    their two best biased scores) are chosen; weights are the unbiased sigmoids, renormalized
    and scaled."""
    g = torch.Generator().manual_seed(2)
    x, router = torch.randn(16, 8, generator=g), torch.randn(12, 8, generator=g)
    bias = torch.randn(12, generator=g) * 0.3
    weights, ids = torch_ref.route_experts(x, router, bias, 3, "sigmoid", True, 4, 2, 2.5)
    scores = (x @ router.t()).sigmoid()
    groups = (scores + bias).view(16, 4, 3).topk(2, dim=-1).values.sum(-1).topk(2, -1).indices
    for t in range(16):
        assert set((ids[t] // 3).tolist()) <= set(groups[t].tolist())
        w = scores[t, ids[t]]
        torch.testing.assert_close(weights[t], 2.5 * w / w.sum())
    soft_w, soft_ids = torch_ref.route_experts(x, router, None, 2, "softmax", False, 1, 1, 1.0)
    probs = (x @ router.t()).softmax(-1)
    torch.testing.assert_close(soft_w, probs.topk(2, dim=-1).values)
    assert torch.equal(soft_ids, probs.topk(2, dim=-1).indices)


def test_fused_moe_is_the_weighted_sum_of_each_tokens_experts():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, generator=g)
    gate_up, down = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    ids = torch.tensor([[0, 3], [1, 3], [3, 2], [0, 1], [2, 0]])
    weights = torch.rand(5, 2, generator=g)
    out = torch_ref.fused_moe(x, gate_up, down, weights, ids)
    for t in range(5):
        want = torch.zeros(8)
        for k in range(2):
            gate, up = (gate_up[ids[t, k]] @ x[t]).chunk(2)
            want += weights[t, k] * (down[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)
