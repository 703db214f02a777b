"""Greedy sampling in Triton: the argmax of each row of the logits.

torch's argmax over one row of a 128k-entry vocabulary runs as one block of 512 threads
(~29 µs on the H200, 0.7 % of a Llama-3.1-8B decode step at batch 1); here one program per row
keeps several loads of its row in flight at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_UNROLL = 4


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """out[row] = the first index of the largest x[row, :V] (NaN counts as the largest, as in
    torch.argmax)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    base = x_ptr + row.to(tl.int64) * stride
    for start in tl.range(0, V, BLOCK, loop_unroll_factor=UNROLL):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf"))
        x = x.to(tl.float32)
        # strict: each lane keeps its first index of a tie; a NaN beats all but a NaN
        better = (x > best) | ((x != x) & (best == best))
        best = tl.where(better, x, best)
        best_i = tl.where(better, start + offs, best_i)
    nan = best != best
    top = tl.max(tl.where(nan, float("-inf"), best), 0)
    pick = tl.where(tl.max(nan.to(tl.int32), 0) > 0, nan, best == top)
    # (some lane is always picked: a NaN lane, else one holding the largest value, -inf too)
    tl.store(out_ptr + row, tl.min(tl.where(pick, best_i, V), 0).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] (rows contiguous) -> [n] int64, as logits.argmax(dim=-1)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _argmax_kernel[(n,)](logits, out, vocab, logits.stride(0), BLOCK=_BLOCK, UNROLL=_UNROLL,
                             num_warps=8)
    return out
