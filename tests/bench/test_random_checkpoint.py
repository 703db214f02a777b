"""benchmarks/random_checkpoint.py --config: a checkpoint at a config's shapes under its
checkpoints' parameter names (one tensor per expert), every value drawn as the dummy loaders
draw them, that frugal and transformers load into the same model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frugal import LLM
from tests.models.test_llama_vs_hf import frugal_logits

transformers = pytest.importorskip("transformers")
SCRIPT = Path(__file__).parents[2] / "benchmarks" / "random_checkpoint.py"


def test_a_moe_config_becomes_a_checkpoint_both_load(tmp_path):
    from safetensors.torch import load_file

    from tests.models.test_mla_vs_hf import CASES

    config_dir, out = tmp_path / "config", tmp_path / "random"
    CASES["deepseek-v3"]().save_pretrained(config_dir)  # (config.json alone)
    (config_dir / "tokenizer_config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--config", str(config_dir),
                        "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "tokenizer_config.json").exists()
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in tensors  # (8 experts, one each)
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0
    for name, t in tensors.items():
        assert t.dim() <= 2 and t.abs().max() <= 1e-3, name  # (no fused experts)

    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    scale = want.abs().max()  # (weights of 1e-3: logits of ~1e-6, compared to the largest)
    torch.testing.assert_close(frugal_logits(llm, ids) / scale, want / scale, atol=1e-3,
                               rtol=0)


def test_router_std_gives_each_token_its_own_experts(tmp_path):
    """--router-std 1: norms 1, no correction bias, and router logits over the first MoE layer's
    inputs of about that standard deviation, so that tokens spread over the experts (with every
    value in ±1e-3 the logits are ~1e-5: the correction bias alone then picks every token's)."""
    from safetensors.torch import load_file

    from tests.models.test_mla_vs_hf import CASES

    config_dir, out = tmp_path / "config", tmp_path / "random"
    CASES["deepseek-v3"]().save_pretrained(config_dir)
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--config", str(config_dir),
                        "--router-std", "1.0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert all((t == 1).all() for k, t in tensors.items() if k.endswith("norm.weight"))
    assert (tensors["model.layers.1.mlp.gate.e_score_correction_bias"] == 0).all()

    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    seen = []
    ref.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        logits = seen[0].reshape(64, -1) @ tensors["model.layers.1.mlp.gate.weight"].float().T
    assert 0.7 < logits.std().item() < 1.4
    assert logits.topk(2, dim=-1).indices.unique().numel() == 8  # (every expert picked)
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    scale = want.abs().max()
    torch.testing.assert_close(frugal_logits(llm, ids.tolist()) / scale, want / scale,
                               atol=1e-3, rtol=0)


def test_layers_keeps_the_first_ones(tmp_path):
    """--layers 2 of a 3-layer Qwen3-MoE config: config.json and the tensors name 2 layers (the
    second the dense one of mlp_only_layers), and frugal serves it."""
    import json

    from safetensors.torch import load_file

    from tests.models.test_moe_vs_hf import CASES

    config_dir, out = tmp_path / "config", tmp_path / "random"
    CASES["qwen3-moe"]().save_pretrained(config_dir)
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--config", str(config_dir),
                        "--layers", "2", "--router-std", "1.0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    names = {k for f in out.glob("*.safetensors") for k in load_file(f)}
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.down_proj.weight" in names  # (the dense layer)
    assert not any(k.startswith("model.layers.2.") for k in names)
    llm = LLM(str(out), dtype="float32", device="cpu", kv_cache_memory="8MiB")
    assert llm.engine.model_config.num_layers == 2
