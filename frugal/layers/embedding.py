"""The token embedding, split by vocabulary rows under tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugal.layers.linear import load_whole, narrow
from frugal.parallel import SINGLE, Parallel


class VocabEmbedding(nn.Module):
    """weight: [length, hidden], the rows (start, length) of the vocabulary this rank holds
    (all of them without tensor parallelism). A token outside them embeds as zeros here, and
    the ranks' embeddings are summed: each token's row comes from the one rank holding it."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.rows = parallel.part(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows[1], hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        load_whole(param, narrow(loaded, 0, self.rows if self.parallel.size > 1 else None))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] int64 -> [num_tokens, hidden]."""
        if self.parallel.size == 1:
            return F.embedding(input_ids, self.weight)
        start, length = self.rows
        mine = (input_ids >= start) & (input_ids < start + length)
        h = F.embedding((input_ids - start).clamp(0, length - 1), self.weight)
        return self.parallel.all_reduce(h * mine[:, None].to(h.dtype))
