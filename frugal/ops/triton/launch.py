"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running; `enter` waits (griddepcontrol.wait) until that kernel has finished and its writes are
visible, which every such kernel does before its first load or store. How early the next kernel
is launched is the mode:
  "wait"    the next kernel is launched as this one's blocks exit (launch latency and block
            scheduling overlap: a few hundred ns per kernel boundary);
  "trigger" each block signals (griddepcontrol.launch_dependents) once past its own wait, so
            the next kernel's blocks are resident, waiting, while this one's last wave drains;
  "early"   each block signals before its wait (kernels queue up as far ahead as SMs allow);
  "0"       no PDL (also in Triton's CPU interpreter and before Hopper).
Waiting is transitive: a kernel's wait returns after the kernel before it has finished, which
was after that one's own wait returned, so the writes of every earlier kernel are visible.

FRUGAL_PDL sets the mode; unset, it is `set_default`'s, which the model runner sets when it
loads a model (one setting per process): "trigger" for bf16 weights (a Llama-3.1-8B decode step
1.9 % faster at batch 1 than "wait"), "wait" with quantized weights, whose kernels ran slower
launched early (INT4 at batch 16: 4.88 against 4.12 ms a step; their split-K grids are one
wave of about two blocks per SM, so blocks that start early and unevenly cost a whole wave);
`benchmarks/decode_step.py` measures it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MODES = {"0": 0, "wait": 1, "trigger": 2, "early": 3}
_default = ["trigger"]


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def set_default(mode: str) -> None:
    """The mode used where FRUGAL_PDL is not set."""
    if mode not in MODES:
        raise ValueError(f"PDL mode {mode!r}: expected one of {', '.join(MODES)}")
    _default[0] = mode


def mode_name() -> str:
    """The name of the PDL mode in effect (FRUGAL_PDL's, else set_default's), as benchmarks
    print it: with PDL a kernel's measured time includes its wait for the one before."""
    return os.environ.get("FRUGAL_PDL", _default[0])


def pdl(device: torch.device) -> int:
    """The PDL mode of kernels launched on `device` now (0: off), to pass as their PDL
    constexpr; launch them with launch_pdl=mode > 0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    name = mode_name()
    if name not in MODES:
        raise ValueError(f"FRUGAL_PDL={name!r}: expected one of {', '.join(MODES)}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return MODES[name] if _supported(index) else 0


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
