"""Shared fixtures: the real default model through frugal and through transformers (CPU, fp32)."""

from __future__ import annotations

import os
import threading

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (tiny shapes)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language at each kernel launch (undone after it) and
    again at every call of a @triton.jit helper inside the kernel, for every program: a walk
    over the language modules with inspect.getmembers each time (a third to two fifths of an
    interpreted model test). Inside a launch, a helper whose language modules (triton.language,
    triton.language.core: those its globals name) are patched already skips the walk. Only
    where the interpreter has the shape this was written against (triton 3.6-3.7): otherwise
    nothing changes."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not triton.__version__.startswith(("3.6.", "3.7.")):
        return
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or executor is None or scope is None:
        return
    launch = executor.__call__
    state = threading.local()  # (per thread: launching, and the modules patched in it)

    def patch_once(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        launching = getattr(state, "launching", False)
        if launching and langs <= state.patched:
            return scope()
        result = patch(fn)
        if launching:
            state.patched = state.patched | langs
        return result

    def launch_patching_once(self, *args, **kwargs):
        outer = getattr(state, "launching", False), getattr(state, "patched", frozenset())
        state.launching, state.patched = True, frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.launching, state.patched = outer

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()

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
