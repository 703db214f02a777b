"""GPTQ: error-compensated INT4 and FP8 beat round-to-nearest on the layer's output, and
`frugal quantize --method gptq` calibrates through the engine and writes a loadable checkpoint."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.cli.gptq import SHRINK, clipped_group_params, gptq, gptq_fp8, hessians, sequential
from frugal.cli.main import main as cli
from frugal.loader.safetensors import SafetensorsCheckpoint
from frugal.quant.fp8 import quantize_fp8
from frugal.quant.int4 import group_params, quantize_rtn
from tests.engine.test_fp8_kv import tiny_dir


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_beats_rtn_on_correlated_inputs(symmetric, act_order):
    g = torch.Generator().manual_seed(1)
    n, k = 96, 256
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(2048, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    x[:, 5] = 0.0  # an input that never fires: its weights may be anything
    x[:, 40:48] *= 6.0  # a few loud inputs (act_order takes them first)
    q = gptq(w, x.double().t() @ x.double(), 64, symmetric, act_order=act_order)
    ref = x @ w.t()

    def err(weight):
        return float((x @ weight.t() - ref).norm() / ref.norm())

    assert q.group_size == 64 and q.shape == (n, k)
    assert err(q.dequantize()) < 0.85 * err(quantize_rtn(w, 64, symmetric).dequantize())
    with pytest.raises(ValueError, match="group_size"):
        gptq(w[:, :96], torch.eye(96), 64, symmetric)


def test_gptq_fp8_beats_round_to_nearest():
    """On correlated inputs GPTQ's error compensation lowers the layer's output error on the
    FP8 grid too (same per-channel scales as round to nearest)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(2048, 256, generator=g) @ (torch.randn(256, 256, generator=g) / 16)
    q = gptq_fp8(w, x.double().t() @ x.double())
    rtn = quantize_fp8(w)
    assert torch.equal(q.scales, rtn.scales)
    ref = x @ w.t()

    def err(weight):
        return float((x @ weight.t() - ref).norm() / ref.norm())

    assert err(q.dequantize()) < 0.8 * err(rtn.dequantize())


@pytest.mark.parametrize("symmetric", [True, False])
def test_clipped_group_params_take_each_groups_least_weighted_error(symmetric):
    """Per group, the factor of SHRINK with the least Σ energy · (w - q)², checked one group at
    a time; symmetric, an outlier with little energy gets clipped, one with much energy not."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 3, 32, generator=g, dtype=torch.float64)
    w[:, :, 0] = 6.0  # an outlier in every group
    energy = torch.rand(3, 32, generator=g, dtype=torch.float64) + 0.5
    energy[0, 0], energy[1, 0] = 1e-3, 1e3  # ... cheap to clip in group 0, costly in group 1
    scale, zero = clipped_group_params(w, energy, symmetric)

    def error(group, s, z):
        q = (torch.round(group / s + z).clamp(0, 15) - z) * s
        return float(((group - q) ** 2 * energy[col]).sum())

    for row in range(5):
        for col in range(3):
            group = w[row, col]
            errors = [error(group, *group_params(group * f, symmetric)) for f in SHRINK]
            assert error(group, scale[row, col], zero[row, col]) == pytest.approx(min(errors))
    plain, _ = group_params(w, symmetric)
    if symmetric:  # (asymmetric, shrinking the range also clips the other end)
        assert (scale[:, 0] < plain[:, 0]).all() and (scale[:, 1] == plain[:, 1]).all()


def test_hessians_see_what_each_matmul_multiplies(llm):
    model = llm.engine.runner.model
    with hessians(model) as found:
        llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=1))
    layer = "model.layers.0"
    assert found[f"{layer}.self_attn.qkv_proj#"] == 5  # the prompt's tokens
    h = found[f"{layer}.mlp.down_proj"]
    assert h.shape == (1536, 1536) and bool(torch.allclose(h, h.t()))
    assert all(not m._forward_pre_hooks for m in model.modules())  # removed on exit


def test_sequential_calibrates_each_layer_after_the_ones_before_are_quantized(tmp_path):
    src = tiny_dir(tmp_path / "src")
    llm = LLM(str(src), device="cpu", dtype="float32", kv_cache_memory="8MiB",
              enforce_eager=True)
    model = llm.engine.runner.model

    def calibrate():
        llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=1))

    with hessians(model) as unquantized:
        calibrate()
    layers = {}
    for name, w in SafetensorsCheckpoint(src).weights():
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            module = name.removesuffix(".weight").replace("q_proj", "qkv_proj")
            layers.setdefault(int(name.split(".")[2]), []).append((name, w, module))
    seen, ran = [], []
    last = model.model.layers[-1].register_forward_hook(lambda *_: ran.append(len(seen)))

    def quantize(w, h):
        seen.append(h)
        return quantize_rtn(w, 32, symmetric=True)

    done = sequential(model, calibrate, layers, quantize)
    last.remove()
    assert ran == [2]  # the last layer ran only in its own pass (after layer 0's 2 matrices)
    assert len(model.model.layers) == 2
    seen = dict(zip([m for i in sorted(layers) for _, _, m in layers[i]], seen))
    assert len(done) == len(seen) == 4
    for module in seen:
        same = torch.allclose(seen[module], unquantized[module] / 7)
        # layer 0 sees the embeddings as before; layer 1 the output of quantized layer 0
        assert same == module.startswith("model.layers.0."), module
    q = model.model.layers[1].self_attn.qkv_proj.weight[:done["model.layers.1.self_attn.q_proj"
                                                            ".weight"].shape[0]]
    assert torch.equal(q, done["model.layers.1.self_attn.q_proj.weight"].dequantize())
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_quantize_gptq_writes_a_loadable_checkpoint(tmp_path, capsys):
    src = tiny_dir(tmp_path / "src")
    out = tmp_path / "gptq"
    assert cli(["quantize", str(src), "--output", str(out), "--group-size", "32",
                "--method", "gptq"]) == 0
    assert "GPTQ calibration: 8 built-in prompts" in capsys.readouterr().err
    weights = dict(SafetensorsCheckpoint(out).weights())
    assert weights["model.layers.0.mlp.down_proj.weight"].group_size == 32
    llm = LLM(str(out), device="cpu", kv_cache_memory="8MiB")
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
               .outputs[0].token_ids) == 4
    assert cli(["quantize", str(src), "--output", str(out), "--calibration-file", "x.txt"]) == 2
    assert "calibration_file, act_order: only with --method gptq" in capsys.readouterr().err
