"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights with HF parameter names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from frugal.config import ModelConfig
from frugal.loader.gguf_quants import dequantize, to_int4
from frugal.quant.int4 import Int4Weight
from frugal.tokenizer import Tokenizer

# GGUF tensor name (inside blk.N.) -> HF name (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same bytes, but slicing skips
    np.memmap's per-slice Python hooks, which made parsing the 100k tokenizer strings take 4 s."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)


class GGUFCheckpoint:
    """An opened GGUF file: `config`, `tokenizer`, `weights()` yielding (hf_name, fp32 tensor);
    with int4, the Q4_0 / Q4_1 matrices of the layers as Int4Weight instead (not re-quantized:
    each 32-weight block is one group)."""

    def __init__(self, path: Path, int4: bool = False) -> None:
        self.path, self.int4 = path, int4
        try:
            self._reader = _Reader(str(path))
        except Exception as e:  # the gguf reader raises bare ValueError/struct errors
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
        self.meta = {k: _field_value(f) for k, f in self._reader.fields.items()}
        arch = self.meta.get("general.architecture")
        if arch not in _ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"({', '.join(_ARCHITECTURES)})")
        self.tokenizer = Tokenizer.from_gguf(self.meta, str(path))
        self.config = self._config(arch)

    def _config(self, arch: str) -> ModelConfig:
        m, names = self.meta, {t.name for t in self._reader.tensors}

        def get(key: str, default: Any = None) -> Any:
            value = m.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{self.path}: GGUF metadata {arch}.{key} is missing")
            return value

        if "rope_freqs.weight" in names or m.get(f"{arch}.rope.scaling.type") not in (None, "none"):
            raise ValueError(f"{self.path}: GGUF rope scaling is not supported")
        num_heads = get("attention.head_count")
        hidden = get("embedding_length")
        return ModelConfig(
            architecture=_ARCHITECTURES[arch],
            vocab_size=get("vocab_size", len(m["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv", num_heads),
            head_dim=get("attention.key_length", hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length"),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            dtype="float32",
        )

    def load_into(self, model: torch.nn.Module) -> None:
        model.load_weights(self.weights())

    def weights(self) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
        """(HF name, float32 tensor or Int4Weight) for every tensor; q/k rows un-permuted back
        to HF order."""
        c = self.config
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                raise ValueError(f"{self.path}: unexpected GGUF tensor {t.name!r}")
            shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dim first
            if (self.int4 and name.startswith("model.layers.") and len(shape) == 2
                    and t.tensor_type.name in ("Q4_0", "Q4_1")):
                w = to_int4(t.data, t.tensor_type, shape)
            else:
                w = dequantize(t.data, t.tensor_type, shape)
            # llama.cpp interleaves the rotary halves of q/k rows; HF keeps them as two halves.
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, c.num_heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, c.num_kv_heads)
            yield name, w


def _unpermute(w: torch.Tensor | Int4Weight, num_heads: int) -> torch.Tensor | Int4Weight:
    """Inverse of llama.cpp's convert permute: rows (head, dim/2, 2) -> (head, 2, dim/2)."""
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    order = torch.arange(out_features).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)
    return w.permute_rows(order) if isinstance(w, Int4Weight) else w[order]


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, _, rest = name.partition(".")
    if prefix == "blk":
        index, _, local = rest.partition(".")
        if local in _LAYER_NAMES and index.isdigit():
            return f"model.layers.{index}.{_LAYER_NAMES[local]}"
    return None


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a field type gguf-py cannot decode is simply not used
        return None
