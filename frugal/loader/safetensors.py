"""HF-style model directories: config.json + *.safetensors, parameter names kept as they are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from frugal.config import ModelConfig
from frugal.quant import compressed, fp8
from frugal.quant.fp8 import Fp8Weight
from frugal.quant.int4 import Int4Weight
from frugal.tokenizer import Tokenizer


class SafetensorsCheckpoint:
    """A HF directory. `config`, `tokenizer` (None without tokenizer.json), `weights()`.
    A compressed-tensors W4A16 checkpoint (quant.compressed) yields its quantized matrices as
    Int4Weight, an FP8 one (quant.fp8: compressed-tensors float-quantized, or block-scaled
    `quant_method: fp8`) as Fp8Weight, under their `.weight` names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = read_config(path)
        try:
            hf = json.loads((path / "config.json").read_text())
            self.fp8 = fp8.checkpoint_form(hf.get("quantization_config"))
            self.int4 = None if self.fp8 is not None else compressed.int4_group(hf)
        except ValueError as e:
            raise ValueError(f"{path / 'config.json'}: {e}") from e
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{path}: no *.safetensors files")
        has_tokenizer = (path / "tokenizer.json").is_file()
        self.tokenizer = (Tokenizer.from_dir(path, self.config.eos_token_ids)
                          if has_tokenizer else None)

    def load_into(self, model: torch.nn.Module) -> None:
        model.load_weights(self.weights())

    def weights(self) -> Iterator[tuple[str, torch.Tensor | Int4Weight | Fp8Weight]]:
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    names = list(f.keys())
                    for name in names:
                        prefix, _, suffix = name.rpartition(".")
                        if self.fp8 is not None:
                            yield from self._fp8(f, names, name)
                        elif self.int4 is None or suffix not in compressed.SUFFIXES:
                            yield name, f.get_tensor(name)
                        elif suffix == "weight_packed":
                            parts = {s: f.get_tensor(f"{prefix}.{s}") for s in compressed.SUFFIXES
                                     if f"{prefix}.{s}" in names}
                            yield f"{prefix}.weight", compressed.from_tensors(parts)
            except (OSError, RuntimeError, KeyError) as e:  # SafetensorError is a RuntimeError
                raise ValueError(f"{file}: cannot read safetensors ({e})") from e

    def _fp8(self, f, names: list[str], name: str
             ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
        """One tensor of an FP8 checkpoint: an FP8 `.weight` with its scale as an Fp8Weight;
        the scales themselves (and static activation scales, unused: activations are scaled
        per token as they come, or stay in the model's dtype) are consumed with it."""
        prefix, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_inv", "input_scale"):
            return
        tensor = f.get_tensor(name)
        if suffix != "weight" or tensor.dtype != fp8.FP8:
            yield name, tensor
            return
        block, w8a8 = self.fp8
        scale_name = f"{prefix}.weight_scale" + ("_inv" if block is not None else "")
        if scale_name not in names:
            raise ValueError(f"FP8 checkpoint: {name} has no {scale_name}")
        yield name, fp8.from_tensors(tensor, f.get_tensor(scale_name), block, w8a8)


def read_config(path: Path) -> ModelConfig:
    """config.json (+ generation_config.json's eos ids, which chat models rely on)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: malformed JSON ({e})") from e
    eos: tuple[int, ...] = ()
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        value = json.loads(gen_file.read_text()).get("eos_token_id")
        if value is not None:
            eos = tuple(value) if isinstance(value, list) else (value,)
    try:
        return ModelConfig.from_hf(hf, eos)
    except KeyError as e:
        raise ValueError(f"{cfg_file}: missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from e
