"""Fault injection for the disaggregation tests, set per worker process by FRUGAL_KV_FAULTS.

A comma-separated list of:
- `corrupt:N`: flip one byte of the N-th prompt (counting from 1) this worker loads, after its
  read and before its checksums are compared: that request must fail alone.
- `delay:S`: look at each read's completion only S seconds after it started, so that an abort
  can land while the request still waits for its KV.
Unset, nothing happens. Only the tests set it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Faults:
    corrupt_load: int | None = None
    read_delay_s: float = 0.0
    num_reads: int = 0

    def after_read(self, pool, pages: list[int]) -> None:
        self.num_reads += 1
        if self.num_reads == self.corrupt_load and pages:
            pool.storage[0, 0, pages[0]].view(-1).view(torch.uint8)[0] ^= 0x5A


def from_env() -> Faults:
    faults = Faults()
    for item in filter(None, os.environ.get("FRUGAL_KV_FAULTS", "").split(",")):
        kind, _, value = item.partition(":")
        if kind == "corrupt":
            faults.corrupt_load = int(value)
        elif kind == "delay":
            faults.read_delay_s = float(value)
        else:
            raise ValueError(f"FRUGAL_KV_FAULTS: unknown fault {item!r} (corrupt:N, delay:S)")
    return faults
