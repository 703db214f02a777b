"""INT4 weights: the packed layout, round-to-nearest, exact GGUF Q4 import, the engine on INT4
weights, and `frugal quantize` written and read back (also by compressed-tensors itself)."""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from frugal import LLM, SamplingParams
from frugal.cli.main import main as cli
from frugal.loader import default_model_path
from frugal.loader.gguf import GGUFCheckpoint
from frugal.loader.gguf_quants import dequantize, to_int4
from frugal.loader.safetensors import SafetensorsCheckpoint
from frugal.quant.int4 import Int4Weight, pack, quantize_rtn, unpack
from tests.engine.test_fp8_kv import tiny_dir


@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' own packing helpers (a test dependency): only the tests comparing
    with it skip without it."""
    return pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


def test_pack_layout_is_compressed_tensors(ct):
    codes = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0))
    packed = pack(codes)
    assert packed.dtype == torch.int32 and packed.shape == (24, 8)
    assert torch.equal(packed, ct.pack_to_int32((codes - 8).to(torch.int8), 4))
    assert torch.equal(unpack(packed), codes.to(torch.uint8))
    assert int(pack(torch.arange(8)[None])[0, 0]) == 0x76543210  # element k at bits 4k


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_round_to_nearest(symmetric, group):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(group)) * 0.05
    w[3, :group] = 0.0  # an all-zero group
    q = quantize_rtn(w, group, symmetric)
    assert q.group_size == group and q.shape == (16, 128)
    scale = q.scales.repeat_interleave(group, 1)
    err = (q.dequantize() - w).abs()
    assert bool((err <= scale / 2 + 1e-7).all())  # half a step at most (±amax included)
    assert bool((q.dequantize()[3, :group] == 0).all())
    assert bool(((q.zeros >= 0) & (q.zeros <= 15)).all())
    assert bool((q.zeros == q.zeros.round()).all())
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(w[:, :96], 64, symmetric)


def test_gguf_q4_import_is_bit_identical():
    ckpt = GGUFCheckpoint(default_model_path())
    checked = 0
    for t in ckpt._reader.tensors:
        if t.tensor_type.name in ("Q4_0", "Q4_1") and checked < 8:
            shape = tuple(int(d) for d in reversed(t.shape))
            q = to_int4(t.data, t.tensor_type, shape)
            assert q.group_size == 32 and (q.mins is not None) == (t.tensor_type.name == "Q4_1")
            assert torch.equal(q.dequantize(), dequantize(t.data, t.tensor_type, shape))
            checked += 1
    assert checked == 8


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_import_equals_gguf_py(kind):
    """Both 4-bit formats (the default model has only Q4_1), written by gguf-py's own quantizer:
    the INT4 import dequantizes to exactly gguf-py's dequantization."""
    t = GGMLQuantizationType[kind]
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    w[2, :32] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(w, t)
    q = to_int4(raw, t, (8, 96))
    assert q.group_size == 32 and (q.zeros is not None) == (kind == "Q4_0")
    assert np.array_equal(q.dequantize().numpy(), gguf.quants.dequantize(raw, t))


def test_int4_engine_equals_its_dequantization(llm):
    """--quantization int4 on the default (Q4_1) model keeps the file's exact weights: the
    same logits and greedy output as the fp32 model dequantized at load."""
    int4 = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB", quantization="int4")
    layer = int4.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj.qweight, Int4Weight)
    assert layer.mlp.gate_up_proj.weight.numel() == 0
    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    got = int4.generate(prompts, params)
    want = llm.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [e.top for e in g.outputs[0].logprobs] == [e.top for e in w.outputs[0].logprobs]


@pytest.mark.parametrize("asymmetric", [False, True])
def test_quantize_writes_what_loads_back(tmp_path, asymmetric, capsys, ct):
    src = tiny_dir(tmp_path / "src")
    out = tmp_path / "int4"
    args = ["quantize", str(src), "--output", str(out), "--group-size", "32"]
    assert cli(args + (["--asymmetric"] if asymmetric else [])) == 0
    printed = capsys.readouterr().out
    assert "quantized 14 matrices" in printed and len(printed.splitlines()) < 10, printed
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not 0600
    original = dict(SafetensorsCheckpoint(src).weights())
    loaded = dict(SafetensorsCheckpoint(out).weights())
    tensors = load_file(out / "model.safetensors")
    for name, w in original.items():
        if not name.endswith("_proj.weight"):
            assert torch.equal(loaded[name], w)  # embeddings, norms, lm_head kept
            continue
        q = loaded[name]
        want = quantize_rtn(w, 32, symmetric=not asymmetric)
        assert torch.equal(q.dequantize(), want.dequantize())
        # compressed-tensors' own unpacking and w = (q - zp) * scale
        prefix = name.removesuffix(".weight")
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        codes = ct.unpack_from_int32(tensors[f"{prefix}.weight_packed"], 4, shape).float()
        zp = torch.zeros_like(q.scales)
        if asymmetric:
            zp = ct.unpack_from_int32(tensors[f"{prefix}.weight_zero_point"], 4,
                                      q.scales.shape, packed_dim=0).float()
        scale = tensors[f"{prefix}.weight_scale"]
        theirs = ((codes.view(*q.scales.shape, 32) - zp[..., None]) * scale[..., None])
        assert torch.equal(theirs.reshape(shape), q.dequantize())
    llm = LLM(str(out), device="cpu", kv_cache_memory="8MiB")
    assert llm.engine.runner.model.model.layers[1].self_attn.o_proj.qweight is not None
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
               .outputs[0].token_ids) == 4


def test_on_the_fly_int4_of_a_float_checkpoint(tmp_path):
    llm = LLM(str(tiny_dir(tmp_path)), device="cpu", kv_cache_memory="8MiB",
              quantization="int4")
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.qweight.group_size == 64  # 64 inputs: the largest group
    assert layer.mlp.down_proj.qweight.group_size == 32  # 96 inputs
    assert llm.engine.runner.model.lm_head.qweight is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantize_streams_into_shards(tmp_path, monkeypatch, capsys):
    """Round to nearest reads and writes one tensor at a time: output past Shards.MAX_BYTES is
    split into files with HF's index, loading back as the single file does; a checkpoint that
    fails part way leaves nothing behind."""
    from frugal.cli.shards import Shards
    src = tiny_dir(tmp_path / "src")
    assert cli(["quantize", str(src), "--output", str(tmp_path / "one"), "--group-size", "32"]) == 0
    monkeypatch.setattr(Shards, "MAX_BYTES", 50_000)
    assert cli(["quantize", str(src), "--output", str(tmp_path / "many"),
                "--group-size", "32"]) == 0
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(files) >= 2 and "model.safetensors" not in files
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    shard_paths = list((tmp_path / "many").glob("*.safetensors"))
    data_bytes = sum(p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
                     for p in shard_paths)  # (each file: 8-byte header length, header, data)
    assert index["metadata"]["total_size"] == data_bytes
    one = dict(SafetensorsCheckpoint(tmp_path / "one").weights())
    many = dict(SafetensorsCheckpoint(tmp_path / "many").weights())
    assert one.keys() == many.keys()
    for name, w in one.items():
        if isinstance(w, Int4Weight):
            assert torch.equal(w.dequantize(), many[name].dequantize())
        else:
            assert torch.equal(w, many[name])
    capsys.readouterr()
    bad = tmp_path / "bad"  # 96 inputs of down_proj: not a multiple of 64
    assert cli(["quantize", str(src), "--output", str(bad), "--group-size", "64"]) != 0
    assert "group_size" in capsys.readouterr().err and not bad.exists()


def test_quantize_again_into_the_same_folder_replaces_the_weights(tmp_path, monkeypatch, capsys):
    """A second run into a folder that holds an earlier run's files (one file, then shards)
    leaves only its own; the input's own folder is refused."""
    from frugal.cli.shards import Shards
    src = tiny_dir(tmp_path / "src")
    out = tmp_path / "out"
    assert cli(["quantize", str(src), "--output", str(out), "--scheme", "fp8"]) == 0
    monkeypatch.setattr(Shards, "MAX_BYTES", 50_000)
    assert cli(["quantize", str(src), "--output", str(out), "--group-size", "32"]) == 0
    assert not (out / "model.safetensors").exists()
    loaded = dict(SafetensorsCheckpoint(out).weights())
    assert isinstance(loaded["model.layers.0.mlp.down_proj.weight"], Int4Weight)
    capsys.readouterr()
    assert cli(["quantize", str(src), "--output", str(src), "--group-size", "32"]) != 0
    assert "holds the input checkpoint" in capsys.readouterr().err
    assert (src / "model.safetensors").exists()


@pytest.mark.parametrize("symmetric", [True, False])
def test_bf16_scales_round_up_and_keep_the_codes_error(symmetric):
    """Scales in bf16 are fp32's rounded up (never below): every weight within half a scale of
    its code's value, as with fp32 scales, and the codes computed with the stored scale."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    w[3, :32] = 0.0  # (an all-zero group: scale 1)
    exact = quantize_rtn(w, 32, symmetric=symmetric)
    q = quantize_rtn(w, 32, symmetric=symmetric, scale_dtype=torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16 and exact.scales.dtype == torch.float32
    assert bool((q.scales.float() >= exact.scales).all())
    assert bool((q.scales.float() <= exact.scales * (1 + 2**-7)).all())
    err = (q.dequantize() - w).abs().view(64, 8, 32).amax(-1)
    assert bool((err <= q.scales.float() * 0.5 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="fp32 or bf16"):
        quantize_rtn(w, 32, symmetric=symmetric, scale_dtype=torch.float16)
