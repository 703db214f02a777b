"""Shared fixtures: the real default model through frugal and through transformers (CPU, fp32)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (tiny shapes)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from frugal import LLM  # noqa: E402
from frugal.loader import default_model_path  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled SmolLM2-135M-Instruct in fp32 on CPU with a roomy pool."""
    return LLM(dtype="float32", device="cpu", kv_cache_memory="512MiB")


@pytest.fixture(scope="session")
def fp8_llm() -> LLM:
    """The default model with an FP8 cache, scales calibrated at start-up (the start-up check
    skipped: tests/engine/test_kv_formats.py)."""
    return LLM(dtype="float32", device="cpu", kv_cache_memory="256MiB", kv_cache_dtype="fp8",
               kv_cache_check=False)


@pytest.fixture(scope="session")
def hf():
    """transformers' own GGUF loading of the same file: (tokenizer, model) in fp32."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    return tok, model.eval()


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
