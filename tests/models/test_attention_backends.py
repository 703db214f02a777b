"""The model config names its attention backend; the backend builds the layers, states the
cache row and says whether decode steps may be captured in CUDA graphs."""

import pytest
import torch

from frugal.layers.attention import backend_for, backend_name, get_backend, graph_capture_blocker
from frugal.layers.attention.mha import MhaAttention
from frugal.layers.attention.mla import MlaAttention
from frugal.model_config import ModelConfig
from frugal.models.llama import LlamaForCausalLM
from frugal.parallel import SINGLE, Parallel

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}
MLA = {**LLAMA, "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 16,
       "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
DSA = {**MLA, "architectures": ["GlmMoeDsaForCausalLM"], "num_hidden_layers": 3,
       "index_topk": 8, "index_n_heads": 2, "index_head_dim": 8,
       "indexer_types": ["full", "shared", "full"]}


@pytest.mark.parametrize("hf, name", [(LLAMA, "mha"), (MLA, "mla"), (DSA, "dsa")])
def test_config_names_its_backend_and_its_cache_row(hf, name):
    mc = ModelConfig.from_hf(hf)
    backend = backend_for(mc)
    assert backend_name(mc) == name and backend.name == name and get_backend(name) is backend
    for fp8 in (False, True):
        for parallel in (SINGLE, Parallel(1, 2)):
            layout = backend.kv_layout(mc, parallel, fp8)
            # MHA's 2 KV heads split across ranks; MLA's one latent head replicated
            heads = 2 // parallel.size if name == "mha" else 1
            assert (layout.parts, layout.num_kv_heads) == (mc.kv_parts, heads)
            assert layout.width == mc.cache_width(fp8)
    assert (backend.kv_layout(mc, SINGLE, True).width
            == mc.head_dim + (16 if name == "dsa" else 0))


def test_every_backend_is_captured():
    """(tests/ops/test_triton_model.py checks MLA's and DSA's graphs against eager steps on
    the GPU.)"""
    for hf in (LLAMA, MLA, DSA):
        assert graph_capture_blocker(ModelConfig.from_hf(hf)) is None


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention backend: unknown 'flash'"):
        get_backend("flash")


@pytest.mark.parametrize("hf, kind, indexers", [(LLAMA, MhaAttention, None),
                                                (MLA, MlaAttention, [False, False]),
                                                (DSA, MlaAttention, [True, False, True])])
def test_model_builds_its_layers_through_the_backend(hf, kind, indexers):
    mc = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        model = LlamaForCausalLM(mc)
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(type(a) is kind for a in layers)
    if indexers is not None:
        assert [a.indexer is not None for a in layers] == indexers
