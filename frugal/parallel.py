"""Tensor parallelism: the share of a layer one process holds, and the collectives that join them.

A model of tensor_parallel_size N runs as N processes (ranks) in one torch.distributed group (Gloo
on CPU, NCCL on GPUs). Column-parallel matmuls hold a share of the outputs (attention heads, the
MLP's intermediate features, experts' intermediate features, vocabulary rows); row-parallel ones
the matching share of the inputs, their partial sums all-reduced before the residual add. Shares
are as even as possible in whole units (a head's rows), the first ranks taking one unit more, so
a model whose head count does not divide by N still splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    """This process's place: rank of size (size 1: the whole model, no collectives)."""

    rank: int = 0
    size: int = 1

    def part(self, n: int, unit: int = 1) -> tuple[int, int]:
        """(start, length) of this rank's share of n items taken in whole units of `unit`."""
        if n % unit:
            raise ValueError(f"{n} items are not whole units of {unit}")
        base, extra = divmod(n // unit, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start * unit, (base + (self.rank < extra)) * unit

    def parts(self, n: int, unit: int = 1) -> list[int]:
        """Every rank's share length of n items (see part)."""
        return [Parallel(r, self.size).part(n, unit)[1] for r in range(self.size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (computed in fp32 for a half-precision x)."""
        if self.size > 1:
            if x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cpu":
                y = x.float()
                dist.all_reduce(y)
                x.copy_(y)
            else:
                dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's x [..., sizes[rank]] joined along the last dim (shares may differ)."""
        if self.size == 1:
            return x
        widest = max(sizes)
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded.contiguous())
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)

    def fewest(self, n: int, device: str) -> int:
        """The least n of any rank."""
        if self.size == 1:
            return n
        t = torch.tensor([n], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, obj: object = None) -> object:
        """Rank 0's obj on every rank (pickled: host objects and tensors)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = Parallel()
