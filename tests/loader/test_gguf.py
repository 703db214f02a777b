"""GGUF reading: block dequantization, q/k un-permutation, config, and clear errors."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from frugal.loader import default_model_path, open_checkpoint
from frugal.loader.gguf import _unpermute
from frugal.loader.gguf_quants import dequantize


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32])
def test_dequantize_matches_gguf_py(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    raw = gguf_quantize(w, qtype)
    ours = dequantize(raw, qtype, (48, 96))
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).reshape(48, 96)
    assert torch.equal(ours, ref)
    if qtype in (T.Q4_0, T.Q4_1):  # the quantization error itself is bounded by the step
        assert (ours - torch.from_numpy(w)).abs().max() < 0.3 * np.abs(w).max()


def test_unsupported_tensor_type():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K, (1, 256))


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, hidden = 3, 8, 5
    w = torch.randn(n_head * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).transpose(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute(permuted, n_head), w)


def test_default_model_config():
    ckpt = open_checkpoint(None)
    c = ckpt.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.vocab_size, c.max_position_embeddings) == (100000.0, 49152, 8192)
    assert c.tie_word_embeddings and c.rms_norm_eps == pytest.approx(1e-5)


def test_default_model_weights_are_hf_named_and_finite():
    names = {}
    for name, w in open_checkpoint(None).weights():
        names[name] = tuple(w.shape)
        assert w.dtype == torch.float32 and torch.isfinite(w).all()
    assert len(names) == 272
    assert names["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert names["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert names["model.embed_tokens.weight"] == (49152, 576)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.gguf does not exist"):
        open_checkpoint(str(tmp_path / "nope.gguf"))


def test_malformed_file_is_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match="broken.gguf"):
        open_checkpoint(str(bad))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(default_model_path().read_bytes()[:4096])
    with pytest.raises(ValueError, match="cut.gguf"):
        open_checkpoint(str(truncated))


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="other.gguf.*'mamba'"):
        open_checkpoint(str(path))


def test_non_gguf_file_is_named(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"xx")
    with pytest.raises(ValueError, match="weights.bin"):
        open_checkpoint(str(f))
