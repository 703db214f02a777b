"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
finishing; it calls `tl.extra.cuda.gdc_wait()` before its first load or store, which returns once
the previous kernel's writes are visible. What overlaps is launch and block scheduling: in a
CUDA graph of tiny batch-1 kernels that is a few hundred ns per kernel boundary. Off in Triton's
CPU interpreter, before Hopper, and with FRUGAL_PDL=0.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (and must wait with gdc_wait)."""
    if (device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("FRUGAL_PDL", "1") == "0"):
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())
