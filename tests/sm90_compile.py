"""A pytest plugin that compiles every Triton kernel the tests launch for the H100/H200 (sm_90)
instead of running it: type and shape errors of branches the CPU interpreter accepts, ptxas
failures (Triton's own ptxas) and kernels needing more shared memory than an sm_90 block has
(227 KB; Triton checks that only when a GPU loads the kernel) show without a GPU.

    TRITON_INTERPRET=0 python -m pytest tests/ops -p tests.sm90_compile -p no:terminal

Launches return without running, so what the tests assert is not checked (their failures are
expected and ignored); the exit status is 1 when any kernel variant failed to compile, and the
report lists each variant (kernel and constexprs) once. Needs Triton's NVIDIA backend (bundled
with its Linux wheels); no driver.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import traceback

import pytest
import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, native_specialize_impl

TARGET = GPUTarget("cuda", 90, 32)
SHARED_BYTES = 232_448  # an sm_90 block's shared memory at most (227 KB, opted in)
_OPTIONS = ("num_warps", "num_stages", "num_ctas")
_results: dict[tuple, str | None] = {}  # variant -> None (compiled) or the error
WIDTHS: dict[str, dict[str, int]] = {}  # repr(variant) -> "path:line" -> widest access, bytes
_LOC = re.compile(r"\.loc\s+(\d+)\s+(\d+)\s+\d+")
_FILE = re.compile(r'\.file\s+(\d+)\s+"([^"]+)"')
_VEC = re.compile(r"\b(?:ld|st)\.global\S*?(?:\.v(\d))?\.[bfsu](\d+)\s")
_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global\s.*?,\s*(0x[0-9a-f]+|\d+)")


def package_path(path: str) -> str:
    """A source file's path from the package down (ops/triton/x.py), whatever the checkout."""
    return path.rsplit("/frugal/", 1)[-1]


def widths(ptx: str) -> dict[str, int]:
    """"path:line" -> the widest global load or store (bytes) the PTX makes for that source line
    (path from the package down, ops/triton/x.py: Triton's cache keeps the path a kernel was
    first compiled from)."""
    files = dict(_FILE.findall(ptx))
    out: dict[str, int] = {}
    where = None
    for line in ptx.splitlines():
        loc = _LOC.search(line)
        if loc:
            where = f"{package_path(files.get(loc.group(1), '?'))}:{loc.group(2)}"
            continue
        vec, size = _VEC.search(line), _ASYNC.search(line)
        width = (int(vec.group(1) or 1) * int(vec.group(2)) // 8 if vec
                 else int(size.group(1), 0) if size else 0)
        if width and where:
            out[where] = max(out.get(where, 0), width)
    return out


def variant(fn, params, args, kwargs) -> tuple:
    """(variant, signature, constants, attrs, options) of a launch of the Python function fn
    with params [(name, is_constexpr, default, do_not_specialize)]: what Triton compiles, by its
    own specialization rules (an integer 1 becomes a constant; pointers and integers divisible
    by 16 are compiled as such)."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    kwargs.pop("launch_pdl", None)
    bound = {**dict(zip([p[0] for p in params], args)), **kwargs}
    signature, constants, attrs = {}, {}, {}
    for i, (name, is_constexpr, default, skip) in enumerate(params):
        value = bound.get(name, default)
        kind, spec = ("constexpr", None) if is_constexpr or value is None else \
            native_specialize_impl(BaseBackend, value, False, not skip, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = value
        elif spec and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn.__module__, fn.__qualname__, tuple(signature.items()),
           tuple((k, repr(v)) for k, v in constants.items()), tuple(options.items()),
           tuple(sorted(attrs)))
    return key, signature, constants, attrs, options


def params(kernel: JITFunction) -> list[tuple]:
    """[(name, is_constexpr, default, do_not_specialize)] of a kernel's parameters, as variant
    takes them."""
    return [(p.name, p.is_constexpr, p.default, p.do_not_specialize) for p in kernel.params]


def _compile(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    variant_, signature, constants, attrs, options = variant(self.fn, params(self), args, kwargs)
    if variant_ not in _results:
        try:
            kernel = triton.compile(ASTSource(self, signature, constants, attrs), target=TARGET,
                                    options=options)
            WIDTHS[repr(variant_)] = widths(kernel.asm["ptx"])
            _results[variant_] = None if kernel.metadata.shared <= SHARED_BYTES else (
                f"shared memory: {kernel.metadata.shared} bytes, more than an sm_90 block's "
                f"{SHARED_BYTES} (the launch would raise OutOfResources)")
        except Exception as e:  # (any compiler error is the finding, with what caused it)
            chain = [e.__cause__ or e.__context__, e]
            _results[variant_] = "".join(line for x in chain if x is not None
                                        for line in traceback.format_exception_only(x))[-2000:]


def keep_launching() -> None:
    """Comparisons pass: a launch here computes nothing (or, interpreted with the GPU's
    configurations, not what the test expects), and a test would stop at its first comparison
    before the launches after it."""
    torch.testing.assert_close = lambda *args, **kwargs: None


def pytest_configure(config) -> None:
    JITFunction.run = _compile
    keep_launching()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    failed = {v: e for v, e in _results.items() if e is not None}
    kernels = {v[:2] for v in _results}
    print(f"\nsm_90: {len(_results)} variants of {len(kernels)} kernels compiled, "
          f"{len(failed)} failed")
    for (module, name, _, constants, *_), error in failed.items():
        flags = {k: v for k, v in constants if k.isupper()}
        print(f"FAILED {module}.{name} {flags}\n{error}")
    session.exitstatus = 1 if failed or not _results else 0
    if os.environ.get("SM90_WIDTHS"):  # (for tests.sm90_align)
        pathlib.Path(os.environ["SM90_WIDTHS"]).write_text(json.dumps(WIDTHS))
