"""FP8 weights: the engine on FP8 weights (rounded at load, or from an FP8 checkpoint), and
`frugal quantize --scheme fp8` written and read back, per channel and in blocks."""

import json

import pytest
import torch
from safetensors.torch import load_file

from frugal import LLM, SamplingParams
from frugal.cli.main import main as cli
from frugal.loader.safetensors import SafetensorsCheckpoint
from frugal.ops import torch_ref
from frugal.quant.fp8 import Fp8Weight, checkpoint_form, quantize_fp8
from tests.engine.test_fp8_kv import tiny_dir

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_on_the_fly_fp8_rounds_every_layer_matrix(tmp_path):
    """--quantization fp8 rounds each layer matrix per output channel and quantizes its
    activations per token (W8A8); the engine then computes exactly as a model given those FP8
    weights by hand; embeddings and the LM head stay."""
    src = tiny_dir(tmp_path)
    llm = LLM(str(src), device="cpu", dtype="float32", kv_cache_memory="8MiB",
              quantization="fp8")
    model = llm.engine.runner.model
    q = model.model.layers[0].mlp.gate_up_proj.qweight
    assert isinstance(q, Fp8Weight) and q.block is None and q.scales.shape == (2 * 96, 1)
    assert q.w8a8 and model.lm_head.qweight is None
    ref = LLM(str(src), device="cpu", dtype="float32", kv_cache_memory="8MiB")
    assert (llm.engine.worker.weights_quantization, ref.engine.worker.weights_quantization) == (
        "fp8", "none")
    for name, module in ref.engine.runner.model.named_modules():
        if getattr(module, "qweight", 1) is None and name.startswith("model.layers."):
            module.qweight = Fp8Weight(*_round(module.weight.data), w8a8=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, PARAMS)]
    assert got == want


def _round(w):
    """FP8 per row, written out: (codes, scales) with scale = max|row| / 448."""
    scale = w.abs().amax(1, keepdim=True) / 448
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def test_w8a8_rounds_the_activations_per_token():
    """torch_ref.linear with a W8A8 weight: norm, then each row of x rounded to FP8 on its own
    scale, then the matmul with the dequantized weight, SiLU·mul and the residual; a row's
    result does not depend on the rows beside it (one token alone gives the same)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g)
    x = torch.randn(20, 48, generator=g) * torch.logspace(-3, 4, 20)[:, None]
    norm, r = torch.rand(48, generator=g) + 0.5, torch.randn(20, 32, generator=g)
    codes, scale = _round(w)
    got = torch_ref.linear(x, Fp8Weight(codes, scale, w8a8=True), norm=norm, eps=1e-6,
                           gated=True, residual=r.clone())
    h = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * norm
    x_codes, x_scale = _round(h)
    y = (x_codes.float() * x_scale) @ (codes.float() * scale).t()
    want = torch.nn.functional.silu(y[:, :32]) * y[:, 32:] + r
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = torch_ref.linear(x, Fp8Weight(codes, scale), norm=norm, eps=1e-6, gated=True,
                             residual=r.clone())
    assert not torch.allclose(plain, want, rtol=1e-3, atol=1e-3)  # W8A16 does not round x
    one = torch_ref.linear(x[5:6], Fp8Weight(codes, scale, w8a8=True), norm=norm, eps=1e-6,
                           gated=True, residual=r[5:6].clone())
    torch.testing.assert_close(one, want[5:6], rtol=1e-5, atol=1e-5)


def test_checkpoint_form_reads_the_activation_scheme():
    fp8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
    group = {"targets": ["Linear"], "weights": fp8}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": group}}
    assert checkpoint_form(ct) == (None, False)
    group["input_activations"] = {"num_bits": 8, "type": "float", "dynamic": True,
                                  "strategy": "token"}
    assert checkpoint_form(ct) == (None, True)
    assert checkpoint_form({"quant_method": "fp8", "activation_scheme": "dynamic"}) == (None, True)
    assert checkpoint_form({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (128, False)


@pytest.mark.parametrize("scheme,block", [("fp8", None), ("fp8", 32), ("w8a16", None)])
def test_quantize_fp8_writes_what_loads_back(tmp_path, scheme, block, capsys):
    """Per-channel fp8 checkpoints name per-token activations (W8A8 when loaded); w8a16 ones
    and block-scaled ones name none (activations kept)."""
    src = tiny_dir(tmp_path / "src")
    out = tmp_path / "fp8"
    args = ["quantize", str(src), "--output", str(out), "--scheme", scheme]
    assert cli(args + (["--weight-block-size", str(block)] if block else [])) == 0
    assert "quantized 14 matrices" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if block:
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == [32, 32]
    else:
        assert config["format"] == "float-quantized"
        group = config["config_groups"]["group_0"]
        assert (group["input_activations"] is not None) == (scheme == "fp8")
    tensors = load_file(out / "model.safetensors")
    original = dict(SafetensorsCheckpoint(src).weights())
    loaded = dict(SafetensorsCheckpoint(out).weights())
    for name, w in original.items():
        if not name.endswith("_proj.weight"):
            assert torch.equal(loaded[name], w)
            continue
        assert tensors[name].dtype == torch.float8_e4m3fn
        want = quantize_fp8(w, block)
        assert torch.equal(loaded[name].data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(loaded[name].scales, want.scales)
    llm = LLM(str(out), device="cpu", kv_cache_memory="8MiB")
    o_proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj.qweight
    assert isinstance(o_proj, Fp8Weight) and o_proj.w8a8 == (scheme == "fp8" and block is None)
    assert llm.engine.worker.weights_quantization == "fp8"  # (loaded as stored, no flag)
    assert len(llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids) == 6


def test_quantize_fp8_rejects_misuse(tmp_path, capsys):
    src = tiny_dir(tmp_path / "src")
    base = ["quantize", str(src), "--output", str(tmp_path / "o")]
    assert cli(base + ["--scheme", "fp8", "--method", "gptq", "--weight-block-size", "128"]) != 0
    assert "gptq quantizes FP8 per channel" in capsys.readouterr().err
    assert cli(base + ["--weight-block-size", "128"]) != 0
    assert "weight_block_size: only with --scheme fp8 or w8a16" in capsys.readouterr().err
