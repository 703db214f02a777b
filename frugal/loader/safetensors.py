"""HF-style model directories: config.json + *.safetensors, parameter names kept as they are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from frugal.config import ModelConfig
from frugal.tokenizer import Tokenizer


class SafetensorsCheckpoint:
    """A HF directory. `config`, `tokenizer` (None without tokenizer.json), `weights()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = read_config(path)
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{path}: no *.safetensors files")
        has_tokenizer = (path / "tokenizer.json").is_file()
        self.tokenizer = (Tokenizer.from_dir(path, self.config.eos_token_ids)
                          if has_tokenizer else None)

    def load_into(self, model: torch.nn.Module) -> None:
        model.load_weights(self.weights())

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (OSError, RuntimeError) as e:  # safetensors raises SafetensorError(RuntimeError)
                raise ValueError(f"{file}: cannot read safetensors ({e})") from e


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
