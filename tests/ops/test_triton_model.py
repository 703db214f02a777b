"""A whole model on the Triton ops equals the torch_ref ops: tiny random Qwen3 (GQA, qk-norm)
in Triton's interpreter on CPU, greedy tokens and logits."""

import pytest
import torch

from frugal import LLM, SamplingParams
from tests.loader.test_hf_dir import write_model
from tests.models.test_llama_vs_hf import frugal_logits

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_backend_matches_torch_ref(tmp_path):
    write_model("qwen3-qk-norm-head-dim", tmp_path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16)
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
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [ids, ids[:17], ids[3:25]]
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


def test_triton_backend_runs_an_mla_model(tmp_path):
    """DeepSeek-V3-shaped (latent attention, q_lora, grouped sigmoid routing): the Triton
    backend (its matmuls, fused MoE and MLA decode kernel; prompts' MLA attention as PyTorch
    ops, no graphs) equals torch_ref."""
    from tests.models.test_mla_vs_hf import write_model as write_mla

    path = str(tmp_path)
    write_mla("deepseek-v3-rope16", path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16)
    ref = LLM(path, ops_backend="torch_ref", **kwargs)
    tri = LLM(path, ops_backend="triton", **kwargs)
    assert tri.engine.runner.graphs is None
    ids = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(frugal_logits(tri, ids), frugal_logits(ref, ids), atol=1e-3,
                               rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [ids, ids[:17]]
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])
