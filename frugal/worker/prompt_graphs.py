"""Steps with prompt tokens replayed from CUDA graphs, by token count and request count.

Launched one kernel at a time, a prompt step of a 48-layer MoE model spends most of its time on
the host (some 600 launches, each Triton's argument binding and a driver call). A step of T new
tokens over R requests (not all of them decodes) instead replays the graph of the smallest
captured pair (tokens, requests) at or above (T, R): tokens on a ladder up to max_tokens,
requests in powers of four up to max_requests.

Token rows past T are padding: token 0 at position 0, slot -1 (nothing stored), in no request
(prompt attention leaves such rows zero: ops.paged_attention). Requests past R have no new
tokens and seq_len 0 (they read nothing). Attention runs every request through the prompt
kernel (max_query_len = the token bucket), whose work items cover the bucket's tokens and
requests (ops.triton.attention) and exit at once past the step's; the LM head reads the rows the
step samples (logits_indices, padded with row 0). Steps are marked `captured`: MLA attends
their tokens absorbed, a row a token, instead of expanding prompts to sizes read on the host.
Hidden states stay inside the graph: steps that score prompt tokens run eagerly, as do steps
that read prompts through the cache (AttentionMetadata.fresh_kv False; the graphs are captured
with it on), steps with a context longer than max_tokens (a long prompt's later chunks: MLA's
absorbed rows would each read the whole context) and models whose attention backend cannot
capture prompts (layers.attention: prompt_graphs; DSA).
"""

from __future__ import annotations

import bisect
import logging
import time
from types import ModuleType

import torch
from torch import nn

from frugal.layers.attention import AttentionMetadata
from frugal.ops.torch_ref.integrity import STATUS_FIELDS
from frugal.worker.cuda_graph import capture_graphs, checked_forward
from frugal.worker.step_inputs import StepInputs

logger = logging.getLogger("frugal")


def token_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, then every multiple of 128 up to max_tokens (itself always included)."""
    sizes = [s for s in (16, 32, 64) if s < max_tokens] + list(range(128, max_tokens, 128))
    return sorted(set(sizes + [max_tokens]))


def request_sizes(max_requests: int) -> list[int]:
    """1, 4, 16, 64, ... below max_requests, and max_requests."""
    sizes, s = [], 1
    while s < max_requests:
        sizes.append(s)
        s *= 4
    return sizes + [max_requests]


class PromptGraphs:
    """Captured graphs of one model for steps with prompt tokens; `run` replays the one that fits.

    Static buffers (device): input_ids, positions, slots [max_tokens] int64; cu_seqlens
    [max_requests + 1] and seq_lens [max_requests] int32; page_table, page_tags [max_requests,
    max_pages] int32 (the halves of tables); rows [max_requests] int64, the hidden rows the LM
    head reads; logits [max_requests, vocab] in the model's dtype; check_status [max_requests,
    4] int32 (the integrity status, with tags). capture False: no graphs, `run` runs the padded
    step eagerly (the padding's semantics tested on any device)."""

    def __init__(self, model: nn.Module, backend: ModuleType, max_tokens: int,
                 max_requests: int, max_model_len: int, page_size: int, vocab_size: int,
                 dtype: torch.dtype, device: str, tags: torch.Tensor | None = None,
                 capture: bool = True) -> None:
        self.model, self.backend = model, backend
        self.page_size, self.tags = page_size, tags
        self.token_sizes = token_sizes(max_tokens)
        self.request_sizes = request_sizes(min(max_requests, max_tokens))
        self.max_tokens, self.max_requests = self.token_sizes[-1], self.request_sizes[-1]
        self.max_pages = -(-max_model_len // page_size)
        self.max_seq_len = self.max_pages * page_size
        with torch.device(device):
            self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64)
            self.positions = torch.zeros(self.max_tokens, dtype=torch.int64)
            self.slots = torch.full((self.max_tokens,), -1, dtype=torch.int64)
            self.cu_seqlens = torch.zeros(self.max_requests + 1, dtype=torch.int32)
            self.seq_lens = torch.zeros(self.max_requests, dtype=torch.int32)
            self.tables = torch.zeros(2, self.max_requests, self.max_pages, dtype=torch.int32)
            self.page_table, self.page_tags = self.tables
            self.rows = torch.zeros(self.max_requests, dtype=torch.int64)
            self.logits = torch.zeros(self.max_requests, vocab_size, dtype=dtype)
            self.check_status = torch.zeros(self.max_requests, STATUS_FIELDS, dtype=torch.int32)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] | None = None
        if capture:
            self._capture(device)

    def _pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, requests) a step can fall in: requests up to the bucket of t (a step
        of T tokens has at most T requests)."""
        sizes = self.request_sizes
        return [(t, r) for t in self.token_sizes for r in sizes
                if r <= sizes[min(bisect.bisect_left(sizes, t), len(sizes) - 1)]]

    def _capture(self, device: str) -> None:
        start = time.perf_counter()
        self.graphs, self.num_bytes = capture_graphs(self._pairs(), self._forward, device)
        logger.info("captured %d prompt CUDA graphs (up to %d tokens of %d requests) in %.1f s, "
                    "%.2f GiB", len(self.graphs), self.max_tokens, self.max_requests,
                    time.perf_counter() - start, self.num_bytes / 2**30)

    def _forward(self, tokens: int, requests: int) -> None:
        meta = AttentionMetadata(self.slots[:tokens], self.page_table[:requests],
                                 self.cu_seqlens[:requests + 1], self.seq_lens[:requests],
                                 max_query_len=tokens, max_seq_len=self.max_seq_len,
                                 num_decodes=0, captured=True)
        checked_forward(self, meta, self.input_ids[:tokens], self.positions[:tokens],
                        self.rows[:requests])

    def fits(self, inputs: StepInputs) -> bool:
        """A step with prompt tokens, fresh K/V (as captured), within the largest graph, and
        no context longer than its token count: a chunk of a long prompt runs eagerly (MLA
        attends a captured step's tokens absorbed, every row reading its whole context)."""
        return (not inputs.decode and inputs.meta.fresh_kv
                and inputs.meta.max_seq_len <= self.max_tokens
                and inputs.input_ids.shape[0] <= self.max_tokens
                and inputs.num_requests <= self.max_requests
                and inputs.meta.page_table.shape[1] <= self.max_pages)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the step's sampled requests, in order ([num_sampled, vocab] in the model's
        dtype), and with tags the integrity status [num_requests, 4]: views of static outputs
        valid until the next run."""
        t, r, n = inputs.input_ids.shape[0], inputs.num_requests, len(inputs.sampled)
        tokens = self.token_sizes[bisect.bisect_left(self.token_sizes, t)]
        requests = self.request_sizes[bisect.bisect_left(self.request_sizes, r)]
        meta = inputs.meta
        self.input_ids[:t].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:t].copy_(inputs.positions, non_blocking=True)
        self.slots[:t].copy_(meta.slot_mapping, non_blocking=True)
        if tokens > t:
            self.input_ids[t:tokens].zero_()
            self.positions[t:tokens].zero_()
            self.slots[t:tokens].fill_(-1)
        self.cu_seqlens[:r + 1].copy_(meta.cu_seqlens_q, non_blocking=True)
        self.seq_lens[:r].copy_(meta.seq_lens, non_blocking=True)
        if requests > r:
            self.cu_seqlens[r + 1:requests + 1].fill_(t)
            self.seq_lens[r:requests].zero_()
        width = meta.page_table.shape[1]
        if self.tags is not None:
            self.tables[:, :r, :width].copy_(inputs.tables, non_blocking=True)
        else:
            self.page_table[:r, :width].copy_(meta.page_table, non_blocking=True)
        self.rows[:n].copy_(inputs.logits_indices, non_blocking=True)
        self.rows[n:requests].zero_()
        if self.graphs is None:  # (eager: the status copied, as a GPU step copies it to the host)
            self._forward(tokens, requests)
            return self.logits[:n], None if self.tags is None else self.check_status[:r].clone()
        self.graphs[tokens, requests].replay()
        return self.logits[:n], None if self.tags is None else self.check_status[:r]
