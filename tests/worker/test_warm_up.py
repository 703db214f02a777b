"""What Triton compiles for a step depends on the step's size class (the blocks its kernels pick),
never on its exact token count: steps of other counts in the same classes compile no new kernel
variant. Triton compiles an integer argument equal to 1 or divisible by 16 as such, so a count
that changes from step to step must be `do_not_specialize`: otherwise the first step of an odd
count compiles while every running request waits (on an H100, the first 16 concurrent prompts of
Kimi K2's shapes waited 3 s for the sorted MoE kernels' odd-slot variants). Checked in Triton's
interpreter, with the launch keys Triton itself would compile (tests.sm90_compile.variant)."""

from __future__ import annotations

import functools
import os

import pytest

from frugal import LLM
from frugal.worker.memory import dummy_steps
from tests.sm90_compile import params, variant

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records launches in Triton's interpreter")


def _record(monkeypatch) -> dict:
    """Patch the interpreter's launches to note each one's variant: key -> kernel name (the
    parameters as Triton's JITFunction reads them from the kernel's source)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen: dict = {}
    run = InterpretedFunction.run

    @functools.cache
    def kernel_params(self) -> list[tuple]:
        return params(JITFunction(self.fn, do_not_specialize=self.kwargs.get("do_not_specialize")))

    def recording(self, *args, grid, warmup, **kwargs):
        key = variant(self.fn, kernel_params(self), args, dict(kwargs))[0]
        seen.setdefault(key, f"{self.fn.__module__}.{self.fn.__qualname__}")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


@pytest.mark.parametrize("case,quantization", [("deepseek-v3", "none"), ("glm4-moe", "int4")])
def test_steps_of_other_token_counts_compile_no_new_variant(case, quantization, tmp_path,
                                                            monkeypatch):
    """A tiny MoE model of 8 experts, top 2, and a shared expert stacked after them (3 slots
    a token, 9 experts): prompts of 16 / 15 tokens (the experts' GEMV) and 32 / 33 (the
    router's and the prompt attention's larger blocks, the sorted GEMMs in blocks of 16 rows:
    up to 16 slots an expert); the first of each pair divisible by 16, the second not."""
    if case == "deepseek-v3":
        from tests.models.test_mla_vs_hf import write_model
    else:
        from tests.models.test_moe_vs_hf import write_model
    write_model(case, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
              page_size=16, ops_backend="triton", quantization=quantization,
              kv_cache_check=False)
    seen = _record(monkeypatch)
    dummy_steps(llm.engine.runner, [(0, 16), (0, 32)])
    first = dict(seen)
    assert any("moe._sorted_gemm" in name for name in first.values())  # (the sorted path ran)
    dummy_steps(llm.engine.runner, [(0, 15), (0, 33)])
    new = sorted(name for key, name in seen.items() if key not in first)
    assert not new, f"kernels compiled again for other token counts: {new}"


def _glm5(path) -> None:
    from tests.models.test_dsa_vs_hf import config, save_random
    # (16 rotary dims: Triton's MLA decode; a dense layer, then an indexer's MoE layer)
    save_random(config(qk_rope_head_dim=16, num_hidden_layers=2, indexer_types=["full", "full"]),
                path)


@pytest.mark.parametrize("case", ["deepseek-v3-rope16", "glm5"])
def test_decodes_of_any_context_compile_nothing_after_warm_up(case, tmp_path, monkeypatch):
    """Once warm_up ran, steps with decodes of other contexts (not a multiple of 16, wider page
    tables, the MLA decode split over keys where warm_up's contexts are one split; DSA: past
    index_topk) compile nothing: their lengths reach the kernels as arguments that Triton must
    not specialize on. (Splits of 16 keys at least instead of 64, so a short context's launch
    has more of them, and the radix top-k from 32 positions instead of 8,192.)"""
    from frugal.ops.triton import dsa, mla_decode
    from frugal.worker.memory import warm_up
    monkeypatch.setattr(mla_decode, "MIN_SPLIT_KEYS", (16, 16))
    monkeypatch.setattr(dsa, "RADIX_MIN", 32)
    if case == "glm5":
        _glm5(tmp_path)
    else:
        from tests.models.test_mla_vs_hf import write_model
        write_model(case, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
              page_size=16, ops_backend="triton", kv_cache_check=False)
    seen = _record(monkeypatch)
    warm_up(llm.engine.runner)
    first = dict(seen)
    assert any("mla_decode._mla_decode" in name for name in first.values())
    dummy_steps(llm.engine.runner, [(1, 15), (3, 49)])
    new = sorted(name for key, name in seen.items() if key not in first)
    assert not new, f"kernels compiled again for other contexts: {new}"
