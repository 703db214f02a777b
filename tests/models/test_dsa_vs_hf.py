"""GLM-5 (GlmMoeDsaForCausalLM: MLA with DeepSeek Sparse Attention) against transformers' own
implementation on a tiny random config: fp32 logits and greedy tokens, with contexts shorter
than index_topk (every position selected: the dense path) and longer (the indexer's top-k),
"full" and "shared" indexer layers, one prefill step and chunked prefill."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.layers.attention.mla import MlaAttention
from tests.loader.test_hf_dir import save_random
from tests.models.test_llama_vs_hf import assert_greedy_matches, assert_logits_match, frugal_logits

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaConfig"):
    pytest.skip("transformers has no GlmMoeDsa (5.2+)", allow_module_level=True)

TOPK = 24


def config(**overrides):
    # (transformers' q_a_layernorm and kv_a_layernorm always take eps 1e-6: so does this config)
    args = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=512, num_experts_per_tok=2, n_routed_experts=8,
                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24, first_k_dense_replace=1, rms_norm_eps=1e-6,
                index_topk=TOPK, index_n_heads=16, index_head_dim=16,
                indexer_types=["full", "shared", "full", "shared"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.GlmMoeDsaConfig(**{**args, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5")
    return path, save_random(config(), path)


def test_config_and_cache_row(model_dir):
    path, _ = model_dir
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    mc = llm.engine.model_config
    assert mc.dsa.topk == TOPK and mc.dsa.full_layers == (0, 2)
    assert mc.head_dim == 32 + 8 + 16  # latent | rotary key | index key
    layers = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert all(isinstance(a, MlaAttention) for a in layers)
    assert [a.indexer is not None for a in layers] == [True, False, True, False]
    assert llm.engine.runner.pool.k[0].shape[-2:] == (1, 56)


@pytest.mark.parametrize("length", [TOPK - 4, 150])
def test_logits_match_transformers(model_dir, length):
    path, ref_model = model_dir
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    ids = torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ours = frugal_logits(llm, ids)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert_logits_match(ours, ref)


@pytest.mark.parametrize("prompt_len,chunk", [(TOPK - 6, 2048), (90, 32)])
def test_greedy_tokens_match_transformers(model_dir, prompt_len, chunk):
    """Decoding across index_topk (from the dense regime into the sparse one), and a prompt
    prefilled in chunks whose later tokens select among earlier chunks' keys."""
    path, ref_model = model_dir
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
              max_num_batched_tokens=chunk)
    prompt = torch.randint(0, 320, (prompt_len,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    assert_greedy_matches(llm, ref_model, prompt, 16)


def test_selection_changes_the_output(model_dir):
    """The sparse path is taken: with index_topk at least the context, the logits differ."""
    path, _ = model_dir
    ids = torch.randint(0, 320, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    sparse = frugal_logits(LLM(str(path), dtype="float32", device="cpu",
                               kv_cache_memory="8MiB"), ids)
    dense_dir = path.parent / "glm5-dense"
    save_random(config(index_topk=512), dense_dir)
    dense = frugal_logits(LLM(str(dense_dir), dtype="float32", device="cpu",
                              kv_cache_memory="8MiB"), ids)
    assert torch.allclose(sparse[:TOPK], dense[:TOPK], atol=1e-5)
    assert (sparse[TOPK:] - dense[TOPK:]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [TOPK - 6, 90])
def test_greedy_tokens_match_transformers_gpu(tmp_path, prompt_len):
    """The Triton kernels (index scores, sparse MLA, MLA decode: rotary width 16) in fp32."""
    ref_model = save_random(config(qk_rope_head_dim=16), tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", kv_cache_memory="64MiB",
              max_num_batched_tokens=32)
    prompt = torch.randint(0, 320, (prompt_len,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    assert_greedy_matches(llm, ref_model, prompt, 16)


@pytest.mark.gpu
@pytest.mark.gpu_alone  # (~57 GB of weights)
@pytest.mark.parametrize("kv_cache_dtype,row", [("auto", 704), ("fp8", 720)])
def test_glm5_real_shapes_gpu(kv_cache_dtype, row):
    """GLM-5's shapes, 4 layers of random weights (3 dense, 1 MoE): prompts of 3,000 tokens
    (past the top-2,048: sparse prefill chunks and decode), in a bf16 and an FP8 cache."""
    import pathlib
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "models" / "glm-5"
    llm = LLM(str(path), load_format="dummy", num_layers=4, dtype="bfloat16", device="cuda",
              kv_cache_memory="4GiB", kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.pool.k[0].shape[-1] == row
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (3000,), generator=g).tolist() for _ in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert llm.engine.check_integrity()
