"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step, and L2
prefetch of the weights a kernel reads before it may read its inputs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running; `enter` waits (griddepcontrol.wait) until that kernel has finished and its writes are
visible, which every such kernel does before its first load of an input or any store. How early
the next kernel is launched is the mode (FRUGAL_PDL):
  "wait"    the next kernel is launched when this one's blocks have exited (launch latency and
            block scheduling overlap, a few hundred ns per kernel boundary);
  "trigger" each block signals (griddepcontrol.launch_dependents) once past its own wait, so the
            next kernel's blocks take SMs as this one's last wave drains, and a matmul can pull
            its weights (which no kernel writes) into L2 with `prefetch` while it waits;
  "early"   each block signals before its wait: kernels launch while the ones before them are
            still waiting too, as far ahead as free SMs allow;
  "0"       no PDL (also in Triton's CPU interpreter and before Hopper).
Waiting is transitive: a kernel's wait returns after the previous kernel has finished, which
was after its own wait returned, so every earlier kernel's writes are visible too.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODES = {"0": 0, "wait": 1, "trigger": 2, "early": 3}
DEFAULT_MODE = "trigger"


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> int:
    """The PDL mode of kernels launched on `device` now (0: off; see the module docstring), to
    pass as their PDL constexpr; launch with launch_pdl=bool(mode)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    name = os.environ.get("FRUGAL_PDL", DEFAULT_MODE)
    if name == "1":
        name = DEFAULT_MODE
    if name not in MODES:
        raise ValueError(f"FRUGAL_PDL={name!r}: expected one of {', '.join(MODES)}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MODES[name] if _supported(index) else 0


def prefetch_bytes(device: torch.device) -> int:
    """How much of its weights (bytes) a matmul program asks L2 for before it waits (FRUGAL_
    PREFETCH, a multiple of 16; 0: none); only where kernels may start early (pdl >= 2)."""
    if pdl(device) < 2:
        return 0
    return int(os.environ.get("FRUGAL_PREFETCH", 1 << 16)) // 16 * 16


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the previous kernel's writes (PDL > 0), signalling the next kernel's launch
    before (PDL == 3) or after (PDL == 2) the wait."""
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch(ptr, nbytes):
    """Ask L2 for `nbytes` bytes from `ptr` (16-byte aligned; nbytes a multiple of 16, > 0),
    from one thread of the program; returns at once (cp.async.bulk.prefetch, sm_90)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(ptrs, nbytes):
    """`prefetch` from each pointer of the tensor `ptrs` (rows of a weight), by the threads
    that hold them (a pointer held by several threads is asked for more than once: harmless)."""
    tl.inline_asm_elementwise(
        "{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
