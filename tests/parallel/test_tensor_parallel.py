"""Tensor parallelism over Gloo, two processes on the CPU, against one process: the default model
(9 query and 3 KV heads: an uneven split, 2 KV heads on rank 0 and 1 on rank 1), a tiny
Qwen3-MoE and GLM-4.5 (experts and shared experts split by intermediate features), and tiny
DeepSeek-V3 and GLM-5 (MLA heads split, the latent replicated): fp32 logits within 1e-4 and
greedy tokens identical."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.parallel import Parallel
from tests.loader.test_hf_dir import save_random
from tests.models.test_llama_vs_hf import frugal_logits

transformers = pytest.importorskip("transformers")


def test_shares_cover_everything_once():
    for n, unit, size in [(9, 3, 2), (3, 1, 2), (1536, 1, 2), (49152, 1, 3), (12, 4, 3)]:
        parts = [Parallel(r, size).part(n, unit) for r in range(size)]
        assert parts[0][0] == 0 and sum(length for _, length in parts) == n
        assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(length % unit == 0 for _, length in parts)
    with pytest.raises(ValueError):
        Parallel(0, 2).part(10, 3)


def moe_config(kind: str):
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2,
                  tie_word_embeddings=False, head_dim=16)
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=96, num_experts=8,
                                           moe_intermediate_size=48, norm_topk_prob=True)
    return transformers.Glm4MoeConfig(**common, intermediate_size=96, n_routed_experts=8,
                                      moe_intermediate_size=48, n_shared_experts=1,
                                      first_k_dense_replace=1, attention_bias=True,
                                      partial_rotary_factor=0.5)


def compare(model: str | None, **kwargs) -> None:
    one = LLM(model, dtype="float32", device="cpu", kv_cache_memory="16MiB", **kwargs)
    two = LLM(model, dtype="float32", device="cpu", kv_cache_memory="16MiB",
              tensor_parallel_size=2, **kwargs)
    try:
        runner, mc = two.engine.runner, two.engine.model_config
        assert runner.parallel == Parallel(0, 2) and all(w.is_alive() for w in two.engine._ranks)
        # rank 0 holds its share: the first KV heads, half the vocabulary and features
        attn = runner.model.model.layers[0].self_attn
        if mc.mla is None:
            assert attn.num_kv_heads == -(-mc.num_kv_heads // 2) < mc.num_kv_heads
            assert runner.pool.k[0].shape[2] == attn.num_kv_heads
        else:  # (the latent is replicated, the heads split)
            assert attn.num_heads == mc.num_heads // 2 and runner.pool.k[0].shape[2] == 1
        if "kv_cache_dtype" in kwargs:
            assert runner.pool.row_scaled and runner.pool.name.startswith(kwargs["kv_cache_dtype"])
        assert runner.model.model.embed_tokens.weight.shape[0] == mc.vocab_size // 2
        assert runner.model.lm_head.weight.shape[0] == mc.vocab_size // 2
        g = torch.Generator().manual_seed(0)
        vocab = one.engine.model_config.vocab_size
        ids = torch.randint(0, vocab, (40,), generator=g).tolist()
        a, b = frugal_logits(one, ids), frugal_logits(two, ids)
        assert b.shape == a.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 23, 64)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert ([o.outputs[0].token_ids for o in two.generate(prompts, params)]
                == [o.outputs[0].token_ids for o in one.generate(prompts, params)])
        assert two.engine.check_integrity()
    finally:
        two.engine.close()
    assert all(not w.is_alive() for w in two.engine._ranks)


def test_default_model_tp2_matches_tp1():
    """SmolLM2-135M: 9 query heads over 3 KV heads, tied vocab-parallel embedding / LM head."""
    compare(None)


@pytest.mark.parametrize("kind", ["qwen3-moe", "glm-4.5"])
def test_tiny_moe_tp2_matches_tp1(kind, tmp_path):
    save_random(moe_config(kind), tmp_path)
    compare(str(tmp_path))


def test_row_parallel_bias_is_added_once_on_every_rank(tmp_path):
    """A tiny Llama with attention biases: o_proj's bias (row-parallel) joins the all-reduced
    sum on each rank, so the ranks' residual streams agree."""
    save_random(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attention_bias=True, tie_word_embeddings=False), tmp_path)
    compare(str(tmp_path))


def test_tp_refuses_what_it_cannot_split_yet(tmp_path):
    from frugal.config import EngineConfig
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=2, kv_role="prefill")


@pytest.mark.parametrize("kind", ["deepseek-v3", "glm-5"])
def test_mla_tp2_matches_tp1(kind, tmp_path):
    """Latent attention: heads split, the latent (and GLM-5's indexer) replicated; GLM-5's
    contexts pass its top-k (24), so the sparse path runs on both ranks."""
    if kind == "glm-5":
        from tests.models.test_dsa_vs_hf import config
        save_random(config(), tmp_path)
    else:
        from tests.models.test_mla_vs_hf import CASES
        save_random(CASES[kind](), tmp_path)
    compare(str(tmp_path))


@pytest.mark.parametrize("fmt", ["int8_per_token_head", "fp8_v"])
def test_row_scaled_kv_tp2_matches_tp1(fmt, tmp_path):
    """KV rows with a scale per token and head split with their heads; every rank runs the
    start-up check (its LM head is vocab-parallel) and they agree."""
    save_random(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256), tmp_path)
    compare(str(tmp_path), kv_cache_dtype=fmt)
