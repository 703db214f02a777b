"""A pytest plugin that checks, on the CPU, that no Triton kernel the tests launch would read or
write a misaligned vector on an H100/H200. Triton vectorizes a load or store from what its
alignment analysis proves; where the proof is wrong the GPU faults with "misaligned address"
(sticky: the process's CUDA context is lost), while the CPU interpreter, which reads element by
element, does not. Two passes (`make align-check`):

    SM90_WIDTHS=w.json TRITON_INTERPRET=0 python -m pytest tests/ops -p tests.sm90_compile
    SM90_WIDTHS=w.json TRITON_INTERPRET=1 python -m pytest tests/ops -p tests.sm90_align

The first compiles every launch for sm_90 with the specialization a GPU launch gets and notes
the widest global access of each source line of its PTX; the second runs the same launches in
the interpreter and checks every load's and store's addresses against that width (a vector of
W bytes starts at a multiple of W), wherever W / element bytes of them run contiguously. A
line's width is its widest access (a helper inlined at several places counts all of them);
launches the first pass does not reach (a test stops at a plain assert on the outputs it
never computed) are listed as not checked; Gluon kernels are not interpreted. The kernels'
wrappers choose their GPU configurations in both passes (their interpreter flags are turned
off here), so the launches are the same; what the tests assert is not checked in the second
(the interpreter's bf16 dot is wrong). The verdict is only as good as the Triton that compiles:
the GPU's (3.6 with torch 2.11) is the one to run it with. Exit status 1 when any access was
misaligned; the report names its line and width.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import json
import os
import pathlib
import pkgutil
import sys

import numpy as np
import pytest
from triton.runtime import interpreter

from tests.sm90_compile import keep_launching, package_path, variant

_widths: dict[str, dict[str, int]] = {}
_current: list[dict[str, int] | None] = []  # the widths of the launch running
_missing: set[str] = set()  # kernels launched here the first pass did not compile
_checked: collections.Counter = collections.Counter()
bad: collections.Counter = collections.Counter()  # (line, width, element) -> misaligned vectors


def _params(fn: interpreter.InterpretedFunction) -> list[tuple]:
    skip = fn.kwargs.get("do_not_specialize") or ()
    out = []
    for i, p in enumerate(inspect.signature(fn.fn).parameters.values()):
        constexpr = "constexpr" in str(p.annotation)
        default = None if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, constexpr, default, p.name in skip or i in skip))
    return out


def _source_line() -> str | None:
    frame = sys._getframe(3)
    while frame is not None:
        if "/frugal/ops/triton/" in frame.f_code.co_filename:
            return f"{package_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _check(ptrs, mask) -> None:
    """Runs of width / element consecutive addresses with a live lane, along the dimension that
    has the most of them (the one Triton vectorizes), must start at a multiple of the width."""
    if not _current or _current[-1] is None:
        return
    where = _source_line()
    width = _current[-1].get(where, 0) if where else 0
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    addr = np.atleast_1d(ptrs.data.astype(np.int64))
    live = np.broadcast_to(np.atleast_1d(mask.data.astype(bool)), addr.shape)
    if width <= size or not live.any():
        return
    run = width // size
    best = None
    for dim in range(addr.ndim):
        whole = addr.shape[dim] // run * run
        if whole == 0:
            continue
        groups = np.moveaxis(addr, dim, -1)[..., :whole]
        groups = groups.reshape(*groups.shape[:-1], -1, run)
        used = np.moveaxis(live, dim, -1)[..., :whole]
        used = used.reshape(*used.shape[:-1], -1, run).any(-1)
        runs = (np.diff(groups, axis=-1) == size).all(-1) & used
        if best is None or runs.sum() > best[0].sum():
            best = runs, groups[..., 0]
    if best is None or not best[0].any():
        return
    runs, starts = best
    _checked[where] += int(runs.sum())
    misaligned = int((runs & (starts % width != 0)).sum())
    if misaligned:
        bad[(where, width, size)] += misaligned


def _gpu_configurations() -> None:
    """The kernels' wrappers as on a GPU: their interpreter flags off."""
    import frugal.ops.triton as package
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"frugal.ops.triton.{info.name}")
        for flag in ("_INTERPRET", "_DOT_F32"):
            if getattr(module, flag, None) is True:
                setattr(module, flag, False)


def pytest_configure(config) -> None:
    path = os.environ.get("SM90_WIDTHS")
    if not path:
        raise pytest.UsageError("tests.sm90_align: SM90_WIDTHS names the first pass's file")
    _widths.update(json.loads(pathlib.Path(path).read_text()))
    _gpu_configurations()
    keep_launching()
    run = interpreter.InterpretedFunction.run
    load = interpreter.InterpreterBuilder.create_masked_load
    store = interpreter.InterpreterBuilder.create_masked_store

    def checked_run(self, *args, grid, warmup, **kwargs):
        key = repr(variant(self.fn, _params(self), args, dict(kwargs))[0])
        if key not in _widths:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            _missing.add(f"{self.fn.__module__}.{self.fn.__qualname__} in {test}")
        _current.append(_widths.get(key))
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            _current.pop()

    def checked_load(self, ptrs, mask, *rest):
        _check(ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        _check(ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    interpreter.InterpretedFunction.run = checked_run
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    print(f"\nsm_90 alignment: {len(_checked)} vectorized lines checked "
          f"({sum(_checked.values())} vectors), {len(bad)} misaligned")
    if _missing:  # (pass 1 stops a test at a plain assert on outputs it never computed)
        print(f"NOT CHECKED, launches the first pass did not reach: {sorted(_missing)}")
    for (line, width, size), count in sorted(bad.items()):
        print(f"MISALIGNED {line}: {width}-byte vectors of {size}-byte elements ({count})")
    session.exitstatus = 1 if bad or not _checked else 0
