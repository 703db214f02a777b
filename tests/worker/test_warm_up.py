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
    """A tiny MoE model of 8 experts, top 2: prompts of 16 / 15 tokens (the experts' GEMV)
    and 48 / 49 (the router's and the prompt attention's larger blocks, the sorted GEMMs); the
    first of each pair divisible by 16, the second not."""
    if case == "deepseek-v3":
        from tests.models.test_mla_vs_hf import write_model
    else:
        from tests.models.test_moe_vs_hf import write_model
    write_model(case, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory="8MiB",
              page_size=16, ops_backend="triton", quantization=quantization,
              kv_cache_check=False)
    seen = _record(monkeypatch)
    dummy_steps(llm.engine.runner, [(0, 16), (0, 48)])
    first = dict(seen)
    assert any("moe._kernel" in name for name in first.values())  # (the sorted path ran)
    dummy_steps(llm.engine.runner, [(0, 15), (0, 49)])
    new = sorted(name for key, name in seen.items() if key not in first)
    assert not new, f"kernels compiled again for other token counts: {new}"
