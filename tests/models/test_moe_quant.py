"""Quantized routed experts end to end: `frugal quantize --experts-only` writes a
compressed-tensors INT4 (group 32, symmetric, as Kimi K2 ships) or a block-scaled FP8 MoE
checkpoint; frugal loads each expert's matrices stacked (quant.experts) and its logits equal the
float model's whose experts were rounded in memory the same way; --num-layers and the presets."""

import json

import pytest
import torch

from frugal import LLM
from frugal.cli.main import main as cli
from frugal.layers.moe import Experts, quantize_moe
from frugal.loader.dummy import PRESETS
from frugal.model_config import ModelConfig, first_layers
from frugal.quant.experts import Fp8Experts, Int4Experts
from tests.models.test_llama_vs_hf import frugal_logits
from tests.models.test_moe_vs_hf import write_model

pytest.importorskip("transformers")
KW = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB")


def experts_of(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("scheme,args,form", [
    ("int4", ["--scheme", "w4a16", "--group-size", "32"], Int4Experts),
    ("fp8", ["--scheme", "w8a16", "--weight-block-size", "16"], Fp8Experts),
    ("fp8", ["--scheme", "fp8"], Fp8Experts)])
def test_experts_only_checkpoint_loads_stacked(scheme, args, form, tmp_path):
    src, out = tmp_path / "src", tmp_path / "q"
    write_model("glm4-moe", src)
    assert cli(["quantize", str(src), "--output", str(out), "--experts-only", *args]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["n_routed_experts"] == 8 and hf["first_k_dense_replace"] == 1  # fields kept
    q = LLM(str(out), **KW)
    for e in experts_of(q):
        assert isinstance(e.qgate_up, form) and isinstance(e.qdown, form)
        assert e.gate_up_proj.numel() == 0
        if scheme == "int4":  # (group scales in bf16, as Kimi K2's)
            assert e.qgate_up.scales.dtype == e.qdown.scales.dtype == torch.bfloat16
        else:  # (a checkpoint whose activations are FP8 too: W8A8 experts)
            assert e.qgate_up.w8a8 == e.qdown.w8a8 == ("fp8" in args)
    for name, module in q.engine.runner.model.named_modules():  # the rest kept in float
        if hasattr(module, "qweight"):
            assert module.qweight is None, name
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = LLM(str(src), **KW, shared_experts_fusion=False)  # (the shared MLP kept float)
    full = frugal_logits(ref, ids)
    if scheme == "int4":  # the same rounding in memory: the same weights, the same logits
        quantize_moe(ref.engine.runner.model, "int4")
        torch.testing.assert_close(frugal_logits(q, ids), frugal_logits(ref, ids), atol=1e-4,
                                   rtol=1e-4)
    rel = (frugal_logits(q, ids) - full).norm() / full.norm()
    assert 0 < rel < 0.1, rel


def test_stacked_experts_quantize_as_per_expert_ones(tmp_path):
    """A checkpoint with transformers 5's stacked expert tensors (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I]) quantizes expert by expert as the per-expert one
    does: the same logits."""
    from safetensors.torch import load_file, save_file

    src, stacked = tmp_path / "src", tmp_path / "stacked"
    write_model("qwen3-moe", src)
    stacked.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    layers = {n.split(".experts.")[0] for n in tensors if ".experts." in n}
    for layer in layers:
        count = len({n for n in tensors if n.startswith(f"{layer}.experts.")}) // 3
        take = [[tensors.pop(f"{layer}.experts.{e}.{m}_proj.weight") for e in range(count)]
                for m in ("gate", "up", "down")]
        tensors[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(take[0], take[1])])
        tensors[f"{layer}.experts.down_proj"] = torch.stack(take[2])
    index = stacked / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    save_file(tensors, stacked / "model.safetensors")
    args = ["--experts-only", "--group-size", "32"]
    ids = [5, 9, 2, 40, 7]
    logits = []
    for d in (src, stacked):
        assert cli(["quantize", str(d), "--output", str(tmp_path / f"{d.name}_q"), *args]) == 0
        logits.append(frugal_logits(LLM(str(tmp_path / f"{d.name}_q"), **KW), ids))
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)


def test_quantize_refuses_what_would_not_load(tmp_path, capsys):
    """Asymmetric INT4 for a MoE model (experts load symmetric only) and a run that matches no
    matrix are refused, and leave no checkpoint behind."""
    write_model("qwen3-moe", tmp_path / "src")
    out = tmp_path / "q"
    for extra, why in ((["--group-size", "32", "--asymmetric"], "asymmetric: routed experts"),
                       (["--ignore", "experts"], "nothing to quantize")):
        assert cli(["quantize", str(tmp_path / "src"), "--output", str(out), "--experts-only",
                    *extra]) != 0
        assert why in capsys.readouterr().err
        assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))


def test_quantization_flag_rounds_experts(tmp_path):
    write_model("qwen3-moe", tmp_path)
    llm = LLM(str(tmp_path), quantization="fp8", **KW)
    assert all(isinstance(e.qgate_up, Fp8Experts) for e in experts_of(llm))
    assert llm.engine.worker.weights_quantization == "fp8"


def test_num_layers_cuts_the_model(tmp_path):
    write_model("glm4-moe", tmp_path)
    llm = LLM(str(tmp_path), num_layers=2, **KW)
    mc = llm.engine.model_config
    assert mc.num_layers == 2 and mc.moe.layers == (1,)
    assert len(llm.engine.runner.model.model.layers) == 2
    with pytest.raises(ValueError, match="num_layers"):
        LLM(str(tmp_path), num_layers=4, **KW)


@pytest.mark.parametrize("name,layers,moe_layers", [("qwen3-30b-a3b", 48, 48),
                                                    ("glm-4.5-air", 46, 45)])
def test_moe_presets(name, layers, moe_layers):
    c = ModelConfig.from_hf(PRESETS[name])
    assert c.num_layers == layers and len(c.moe.layers) == moe_layers
    assert c.moe.num_experts == 128 and c.moe.top_k == 8
    assert first_layers(c, 3).moe.layers == ((0, 1, 2) if name.startswith("qwen") else (1, 2))


def test_int4_experts_load_bit_identical_and_as_compressed_tensors_reads_them(tmp_path):
    """Each stacked expert is the file's packed words and scales, bit for bit, and
    compressed-tensors' own unpacking of the file gives the same dequantized matrix."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from safetensors.torch import load_file

    src, out = tmp_path / "src", tmp_path / "q"
    write_model("qwen3-moe", src)
    assert cli(["quantize", str(src), "--output", str(out), "--experts-only",
                "--group-size", "32"]) == 0
    tensors = load_file(out / "model.safetensors")
    llm = LLM(str(out), **KW)
    layer = llm.engine.runner.model.model.layers[0]
    experts = layer.mlp.experts
    inter = experts.intermediate_size
    for e in range(experts.num_experts):
        for part, stacked, rows in (("gate", experts.qgate_up, slice(0, inter)),
                                    ("up", experts.qgate_up, slice(inter, 2 * inter)),
                                    ("down", experts.qdown, slice(None))):
            prefix = f"model.layers.0.mlp.experts.{e}.{part}_proj"
            packed, scale = tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"]
            assert torch.equal(stacked.packed[e][rows], packed)
            assert torch.equal(stacked.scales[e][rows].to(scale.dtype), scale)
            shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
            codes = ct.unpack_from_int32(packed, 4, shape).float()  # signed, as they store
            theirs = (codes.view(*scale.shape, 32) * scale.float()[..., None]).reshape(shape)
            assert torch.equal(theirs, stacked.expert(e).dequantize()[rows])


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path):
    """transformers 5's in-memory layout as checkpoint tensors (experts.gate_up_proj
    [E, 2 inter, hidden], experts.down_proj [E, hidden, inter]) loads to the same model."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    src, fused = tmp_path / "src", tmp_path / "fused"
    write_model("qwen3-moe", src)
    shutil.copytree(src, fused)
    tensors = load_file(src / "model.safetensors")
    out, parts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            parts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3)] = t
        else:
            out[name] = t
    for prefix, p in parts.items():
        n = max(e for e, _ in p) + 1
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([p[e, "gate"], p[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([p[e, "down"] for e in range(n)])
    (fused / "model.safetensors").unlink()
    save_file(out, fused / "model.safetensors")
    ids = list(range(3, 30))
    torch.testing.assert_close(frugal_logits(LLM(str(fused), **KW), ids),
                               frugal_logits(LLM(str(src), **KW), ids), atol=0, rtol=0)


def test_kimi_style_int4_experts_of_an_mla_model(tmp_path):
    """A DeepSeek-V3 (Kimi K2) checkpoint with only its routed experts in INT4 (group 32,
    symmetric), as Kimi K2.x ships: the experts load stacked as stored, attention, shared
    experts and the dense layer stay float, logits as the in-memory rounding's."""
    from tests.models.test_mla_vs_hf import write_model as write_mla

    src, out = tmp_path / "src", tmp_path / "q"
    write_mla("deepseek-v3", src)
    assert cli(["quantize", str(src), "--output", str(out), "--experts-only",
                "--group-size", "32"]) == 0
    q = LLM(str(out), **KW)
    assert all(isinstance(e.qgate_up, Int4Experts) for e in experts_of(q))
    assert all(getattr(m, "qweight", None) is None for m in q.engine.runner.model.modules())
    ref = LLM(str(src), **KW, shared_experts_fusion=False)  # (the shared MLP kept float)
    quantize_moe(ref.engine.runner.model, "int4")
    ids = list(range(5, 40))
    torch.testing.assert_close(frugal_logits(q, ids), frugal_logits(ref, ids), atol=1e-4,
                               rtol=1e-4)
