"""A whole model on the Triton ops equals the torch_ref ops: tiny random Qwen3 (GQA, qk-norm)
in Triton's interpreter on CPU, greedy tokens and logits."""

import pytest
import torch

from frugal import LLM, SamplingParams
from tests.loader.test_hf_dir import write_model
from tests.models.test_llama_vs_hf import frugal_logits

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kv", ["auto", "int8_per_token_head"])
def test_triton_backend_matches_torch_ref(kv, tmp_path):
    """(int8 rows: prompt steps read their own K/V as computed, the rotated k the store hands
    back, and the context before them from the cache)"""
    write_model("qwen3-qk-norm-head-dim", tmp_path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16,
                  kv_cache_dtype=kv, kv_cache_check=False)  # (its start-up check: test_kv_formats)
    ref = LLM(str(tmp_path), ops_backend="torch_ref", **kwargs)
    tri = LLM(str(tmp_path), ops_backend="triton", **kwargs)
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(frugal_logits(tri, ids), frugal_logits(ref, ids), atol=1e-3,
                               rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [ids, ids[:20], ids[5:30]]  # prefill batch, then batched decode
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


@pytest.mark.parametrize("quantization", ["none", "int4", "fp8"])
def test_triton_backend_runs_a_moe_model_with_partial_rotary(quantization, tmp_path):
    """GLM-4.5-shaped (grouped sigmoid routing, shared experts, a dense first layer, RoPE on
    half of each head): the Triton backend's rotary store, attention and fused MoE kernels
    (float, INT4 or FP8 experts), equal to torch_ref; on a GPU decode steps replay CUDA
    graphs with the experts inside."""
    from tests.models.test_moe_vs_hf import write_model as write_moe

    write_moe("glm4-moe", tmp_path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16,
                  quantization=quantization)
    ref = LLM(str(tmp_path), ops_backend="torch_ref", **kwargs)
    tri = LLM(str(tmp_path), ops_backend="triton", **kwargs)
    assert (tri.engine.runner.graphs is not None) == (DEVICE == "cuda")
    ids = torch.randint(0, 320, (33,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(frugal_logits(tri, ids), frugal_logits(ref, ids), atol=1e-3,
                               rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)  # (2 decode steps)
    prompts = [ids, ids[:17], ids[3:25]]
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


@pytest.mark.parametrize("kv", ["auto", "int8_per_token_head"])
def test_triton_backend_runs_an_mla_model(kv, tmp_path):
    """DeepSeek-V3-shaped (latent attention, q_lora, grouped sigmoid routing): the Triton
    backend (its matmuls, fused MoE, latent store, MLA decode kernel, and prompts expanded
    through its paged attention; decode graphs on a GPU) equals torch_ref, with an fp32 cache
    or with int8 rows that carry their own scale (the interpreter converts some values to FP8
    wrongly)."""
    from tests.models.test_mla_vs_hf import write_model as write_mla

    path = str(tmp_path)
    write_mla("deepseek-v3-rope16", path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16,
                  kv_cache_dtype=kv, kv_cache_check=False)
    ref = LLM(path, ops_backend="torch_ref", **kwargs)
    tri = LLM(path, ops_backend="triton", **kwargs)
    assert (tri.engine.runner.graphs is not None) == (DEVICE == "cuda")
    ids = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(frugal_logits(tri, ids), frugal_logits(ref, ids), atol=1e-3,
                               rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [ids, ids[:17]]
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


def _same_outputs(graphs: LLM, eager: LLM, seed: int) -> None:
    """Three random prompts (7, 40, 90 tokens), 12 greedy tokens: the same tokens from both
    engines, log-probabilities within 1e-4."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    ours = [o.outputs[0] for o in graphs.generate(prompts, params)]
    want = [o.outputs[0] for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in ours] == [o.token_ids for o in want]
    torch.testing.assert_close(torch.tensor([[lp.logprob for lp in o.logprobs] for o in ours]),
                               torch.tensor([[lp.logprob for lp in o.logprobs] for o in want]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["deepseek-v3-rope16", "glm-5", "glm-5-radix"])
def test_mla_decode_graphs_replay_as_eager(case, tmp_path, monkeypatch):
    """Decode steps of an MLA model (and of GLM-5's sparse path: contexts past its top-k and
    short of it) replayed from CUDA graphs give the eager steps' tokens and log-probabilities.
    glm-5-radix: the graphs' top-k by the radix select over rows cut at each context (a graph's
    step takes it whatever its scores), the eager steps' by torch.topk."""
    from frugal.ops.triton import dsa
    from tests.loader.test_hf_dir import save_random
    from tests.models.test_mla_vs_hf import write_model as write_mla

    if case == "glm-5-radix":
        monkeypatch.setattr(dsa, "RADIX_MIN", 32)
        monkeypatch.setattr(dsa, "RADIX_MAX", 0)
    if case.startswith("glm-5"):
        from tests.models.test_dsa_vs_hf import config
        save_random(config(qk_rope_head_dim=16), tmp_path)
    else:
        write_mla(case, str(tmp_path))
    kwargs = dict(dtype="float32", device="cuda", kv_cache_memory="64MiB")
    graphs = LLM(str(tmp_path), **kwargs)
    eager = LLM(str(tmp_path), enforce_eager=True, **kwargs)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    _same_outputs(graphs, eager, seed=6)


@pytest.mark.gpu
def test_mla_prompt_graphs_replay_as_eager(tmp_path):
    """An MLA model's steps with prompt tokens replayed from CUDA graphs (each token attended
    absorbed over its own context) give the eager engine's tokens and log-probabilities."""
    from frugal.config import CacheConfig, EngineConfig, SchedulerConfig
    from tests.models.test_mla_vs_hf import write_model as write_mla

    write_mla("deepseek-v3-rope16", str(tmp_path))

    def engine(**kwargs):
        return LLM.from_config(EngineConfig(
            model=str(tmp_path), dtype="float32", device="cuda",
            cache=CacheConfig(kv_cache_memory="64MiB"),
            scheduler=SchedulerConfig(max_num_batched_tokens=64), **kwargs))

    graphs, eager = engine(prompt_graph_max_tokens=64), engine(enforce_eager=True)
    assert graphs.engine.runner.prompt_graphs is not None
    _same_outputs(graphs, eager, seed=7)
