"""A pytest plugin that compiles every Triton kernel the tests launch for the H100/H200 (sm_90)
instead of running it: type and shape errors of branches the CPU interpreter accepts, register
or shared-memory overflows and ptxas failures show without a GPU (Triton's own ptxas).

    TRITON_INTERPRET=0 python -m pytest tests/ops -p tests.sm90_compile -p no:terminal

Launches return without running, so what the tests assert is not checked (their failures are
expected and ignored); the exit status is 1 when any kernel variant failed to compile, and the
report lists each variant (kernel and constexprs) once. Needs Triton's NVIDIA backend (bundled
with its Linux wheels); no driver.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
          torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas")
_results: dict[tuple, str | None] = {}  # variant -> None (compiled) or the error
PTX: dict[tuple, str] = {}


def _aligned(value, param) -> bool:
    """Triton's specialization: a pointer or integer divisible by 16 is compiled as such."""
    if param.do_not_specialize:
        return False
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    return "fp32"


def _compile(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    kwargs.pop("launch_pdl", None)
    bound = {**dict(zip(self.arg_names, args)), **kwargs}
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(self.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constants[param.name] = value
        else:
            signature[param.name] = _type(value)
            if _aligned(value, param):
                attrs[(i,)] = [["tt.divisibility", 16]]
    variant = (self.fn.__module__, self.fn.__qualname__, tuple(signature.items()),
               tuple((k, repr(v)) for k, v in constants.items()), tuple(options.items()),
               tuple(sorted(attrs)))
    if variant not in _results:
        try:
            kernel = triton.compile(ASTSource(self, signature, constants, attrs), target=TARGET,
                                    options=options)
            PTX[variant] = kernel.asm["ptx"]
            _results[variant] = None
        except Exception as e:  # (any compiler error is the finding, with what caused it)
            chain = [e.__cause__ or e.__context__, e]
            _results[variant] = "".join(line for x in chain if x is not None
                                        for line in traceback.format_exception_only(x))[-2000:]


def pytest_configure(config) -> None:
    JITFunction.run = _compile


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    failed = {v: e for v, e in _results.items() if e is not None}
    kernels = {v[:2] for v in _results}
    print(f"\nsm_90: {len(_results)} variants of {len(kernels)} kernels compiled, "
          f"{len(failed)} failed")
    for (module, name, _, constants, _), error in failed.items():
        flags = {k: v for k, v in constants if k.isupper()}
        print(f"FAILED {module}.{name} {flags}\n{error}")
    session.exitstatus = 1 if failed or not _results else 0
