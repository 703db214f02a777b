"""Decode steps replayed from CUDA graphs captured at a ladder of batch sizes.

A decode step of B requests (one new token each) runs the graph of the smallest captured size
>= B. The graph reads static input buffers; rows past B are padding: slot -1 (their K/V is not
stored) and context length 0 (their attention reads nothing), so they touch no real page. The
attention launch grid is sized for max_model_len when capturing; the Triton decode kernel finds
each request's slice of the context from its seq_len at run time. With tags (the pool's page
tags), every graph starts with the KV-cache integrity check (ops.check_kv_pages), so a decode
step stays one replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from frugal import ops
from frugal.layers.attention import AttentionMetadata
from frugal.ops.torch_ref.integrity import STATUS_FIELDS
from frugal.worker.step_inputs import StepInputs

logger = logging.getLogger("frugal")


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_bs (max_bs itself always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


def capture_graphs(keys: list, forward: Callable, device: str) -> tuple[dict, int]:
    """A CUDA graph of forward(*key) (or forward(key)) for each key, the largest first so the
    others reuse its memory (one pool), each run once outside its capture to compile its
    kernels; and the device bytes the graphs took."""
    graphs, pool = {}, None
    before = torch.cuda.memory_reserved(device)
    for key in sorted(keys, reverse=True):
        args = key if isinstance(key, tuple) else (key,)
        forward(*args)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward(*args)
        pool = graph.pool()
        graphs[key] = graph
    torch.cuda.synchronize(device)
    return graphs, torch.cuda.memory_reserved(device) - before


def checked_forward(graphs, meta: AttentionMetadata, input_ids: torch.Tensor,
                    positions: torch.Tensor, rows: torch.Tensor | None) -> None:
    """A graph set's step over its static buffers: the integrity check (with tags, into its
    check_status), the model, and the logits of the hidden rows `rows` (None: all) into its
    logits."""
    n = meta.seq_lens.shape[0]
    with ops.use(graphs.backend):
        if graphs.tags is not None:
            ops.check_kv_pages(meta.page_table, graphs.page_tags[:n], graphs.tags,
                               meta.seq_lens, meta.cu_seqlens_q, meta.slot_mapping,
                               graphs.page_size, status=graphs.check_status[:n])
        hidden = graphs.model(input_ids, positions, meta)
        if rows is not None:
            hidden = hidden[rows]
        graphs.logits[:n].copy_(graphs.model.compute_logits(hidden, upcast=False))


class DecodeGraphs:
    """Captured decode graphs of one model; `run` replays the one that fits a step.

    Static buffers (device): input_ids, positions, slots [max_bs] int64; seq_lens [max_bs] int32;
    cu_seqlens [max_bs + 1] int32 = 0..max_bs; page_table, page_tags [max_bs, max_pages] int32
    (the two halves of tables [2, max_bs, max_pages]);
    logits [max_bs, vocab] in the model's dtype (as the LM head computes them), the output of
    every graph; check_status [max_bs, 4] int32, the integrity status the graphs with tags
    write (allocated even without tags, so both kinds of graph set lay out memory alike).
    capture False: no graphs, `run` runs the padded step eagerly (the padding's semantics tested
    on any device).
    """

    def __init__(self, model: nn.Module, backend: ModuleType, max_bs: int, max_model_len: int,
                 page_size: int, vocab_size: int, dtype: torch.dtype, device: str,
                 tags: torch.Tensor | None = None, capture: bool = True) -> None:
        self.model, self.backend = model, backend
        self.page_size, self.tags = page_size, tags
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.max_pages = -(-max_model_len // page_size)
        self.max_seq_len = self.max_pages * page_size
        with torch.device(device):
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64)
            self.positions = torch.zeros(max_bs, dtype=torch.int64)
            self.slots = torch.full((max_bs,), -1, dtype=torch.int64)
            self.seq_lens = torch.zeros(max_bs, dtype=torch.int32)
            self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32)
            # page_table and page_tags side by side: one copy fills both
            self.tables = torch.zeros(2, max_bs, self.max_pages, dtype=torch.int32)
            self.page_table, self.page_tags = self.tables
            self.logits = torch.zeros(max_bs, vocab_size, dtype=dtype)
            # static too, so a graph set with the check lays out its memory as one without
            self.check_status = torch.zeros(max_bs, STATUS_FIELDS, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] | None = None
        if capture:
            start = time.perf_counter()
            self.graphs, self.num_bytes = capture_graphs(self.sizes, self._forward, device)
            logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.2f GiB",
                        len(self.sizes), self.max_bs, time.perf_counter() - start,
                        self.num_bytes / 2**30)

    def _forward(self, bs: int) -> None:
        meta = AttentionMetadata(self.slots[:bs], self.page_table[:bs], self.cu_seqlens[:bs + 1],
                                 self.seq_lens[:bs], max_query_len=1, max_seq_len=self.max_seq_len,
                                 num_decodes=bs)
        checked_forward(self, meta, self.input_ids[:bs], self.positions[:bs], None)

    def fits(self, inputs: StepInputs) -> bool:
        return (inputs.decode and inputs.num_requests <= self.max_bs
                and inputs.meta.page_table.shape[1] <= self.max_pages)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of every request of a decode step: [num_requests, vocab] in the model's dtype,
        and with tags the integrity status [num_requests, 4]: views of static outputs valid
        until the next run."""
        b = inputs.num_requests
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        meta = inputs.meta
        self.input_ids[:b].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:b].copy_(inputs.positions, non_blocking=True)
        self.slots[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        width = meta.page_table.shape[1]
        if self.tags is not None:
            self.tables[:, :b, :width].copy_(inputs.tables, non_blocking=True)
        else:
            self.page_table[:b, :width].copy_(meta.page_table, non_blocking=True)
        if bs > b:
            self.slots[b:bs].fill_(-1)
            self.seq_lens[b:bs].zero_()
        if self.graphs is None:  # (eager: the status copied, as a GPU step copies it to the host)
            self._forward(bs)
            return self.logits[:b], None if self.tags is None else self.check_status[:b].clone()
        self.graphs[bs].replay()
        return self.logits[:b], None if self.tags is None else self.check_status[:b]
