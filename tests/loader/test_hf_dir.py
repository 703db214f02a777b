"""HF directories (config.json + safetensors): tiny random Llama / Qwen2 / Qwen3 written by
transformers, loaded by frugal, logits compared in fp32; dummy weights from a config or preset."""

import json

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.loader import open_checkpoint
from tests.models.test_llama_vs_hf import frugal_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = {
    "llama3-rope-scaling-untied": (transformers.LlamaConfig, dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-attention-bias": (transformers.LlamaConfig, dict(attention_bias=True,
                                                            tie_word_embeddings=True)),
    "qwen2-qkv-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qk-norm-head-dim": (transformers.Qwen3Config, dict(head_dim=32,
                                                              tie_word_embeddings=False)),
}


def write_model(case: str, path) -> torch.nn.Module:
    cls, extra = CASES[case]
    return save_random(cls(**COMMON, **extra), path)


def save_random(config, path) -> torch.nn.Module:
    """transformers' model of config with random weights (not the default init, so biases,
    norms and an MoE router's correction bias matter), saved to path."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_directory_logits_match(case, tmp_path):
    ref_model = write_model(case, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    assert llm.get_tokenizer() is None
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = frugal_logits(llm, ids)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ref_model.generation_config.eos_token_id = None  # as ignore_eos
    with torch.inference_mode():
        gen = ref_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out[0].outputs[0].token_ids == gen[0, 40:].tolist()


def test_dummy_weights_from_directory(tmp_path):
    write_model("qwen2-qkv-bias", tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", kv_cache_memory="8MiB")
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_weights_are_drawn_as_vllm_draws_them(tmp_path):
    """uniform (the default): every weight, norms included, in [-1e-3, 1e-3], each parameter
    from a freshly seeded generator (as vLLM's dummy loader); normal: N(0, 0.02²), norms 1."""
    write_model("qwen3-qk-norm-head-dim", tmp_path)
    model = LLM(str(tmp_path), load_format="dummy", device="cpu",
                kv_cache_memory="8MiB").engine.runner.model
    weights = dict(model.named_parameters())
    assert all(float(w.abs().max()) <= 1e-3 for w in weights.values() if w.is_floating_point())
    norm = next(w for name, w in weights.items() if "norm" in name)
    assert float(norm.abs().max()) <= 1e-3 and float(norm.std()) > 1e-4
    other = LLM(str(tmp_path), load_format="dummy", dummy_init="normal", device="cpu",
                kv_cache_memory="8MiB").engine.runner.model
    norm = next(w for name, w in other.named_parameters() if "norm" in name)
    assert bool((norm == 1).all())
    with pytest.raises(ValueError, match="dummy_init: unsupported 'zeros'"):
        LLM(str(tmp_path), load_format="dummy", dummy_init="zeros", device="cpu")


def test_dummy_presets_have_real_shapes():
    c = open_checkpoint("llama-3.1-8b", "dummy").config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (32, 4096, 32, 8)
    assert c.rope_scaling["rope_type"] == "llama3" and not c.tie_word_embeddings
    q = open_checkpoint("qwen3-8b", "dummy").config
    assert q.qk_norm and q.head_dim == 128 and q.num_layers == 36


def test_directory_errors_are_named(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: malformed"):
        open_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "vocab_size": 10}))
    with pytest.raises(ValueError, match="config.json: missing field"):
        open_checkpoint(str(tmp_path))
    cfg = {"architectures": ["MambaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no .*safetensors"):
        open_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")
