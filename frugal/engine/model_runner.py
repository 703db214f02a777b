"""Builds the model and its KV pool, turns a scheduled step into tensors, runs it, samples."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from frugal import ops
from frugal.config import DTYPES, EngineConfig, available_memory_bytes
from frugal.engine.sampler import Sampler, token_logprobs
from frugal.engine.scheduler import SchedulerOutput
from frugal.kv_cache.pool import KVPool
from frugal.layers.attention import AttentionMetadata
from frugal.loader import Checkpoint
from frugal.models.registry import model_class
from frugal.request import Request, TokenLogprob

logger = logging.getLogger("frugal")


@dataclass
class StepInputs:
    """One step's model inputs. logits_indices: rows of the hidden states to sample from
    (the last new token of each request whose computed tokens reach its num_tokens)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64
    sampled: list[int]  # indices into SchedulerOutput.requests that sample this step
    cu_seqlens: list[int]  # request i's new tokens are rows cu_seqlens[i]:cu_seqlens[i+1]


@dataclass
class StepResult:
    """What one step produced. sampled[i] indexes SchedulerOutput.requests and got tokens[i];
    logprobs and prompt_logprobs are keyed by position in sampled and in requests."""

    sampled: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptScores] = field(default_factory=dict)


@dataclass
class PromptScores:
    """Scores of prompt tokens first, first+1, ...: top-k entries and/or full log-prob rows."""

    first: int
    entries: list[TokenLogprob] | None = None
    tensor: torch.Tensor | None = None  # [num_scored, vocab] fp32 log-probabilities


_LOGITS_ROWS = 256  # prompt positions scored per lm_head call (bounds [rows, vocab] memory)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """Owns the model, the KV pool and the sampler on one device."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        self.device = config.resolved_device()
        self.model_config = mc = checkpoint.config
        self.dtype = config.resolved_dtype(mc)
        self.backend = ops.load(config.resolved_ops_backend())
        start = time.perf_counter()
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = model_class(mc)(mc)
        checkpoint.load_into(self.model)
        logger.info("loaded %s (%s, %d layers) in %.1f s as %s on %s, %s ops", mc.architecture,
                    type(checkpoint).__name__, mc.num_layers, time.perf_counter() - start,
                    str(self.dtype).removeprefix("torch."), self.device,
                    self.backend.__name__.rsplit(".", 1)[-1])
        cache = config.cache
        kv_dtype = self.dtype if cache.kv_cache_dtype == "auto" else DTYPES[cache.kv_cache_dtype]
        page_bytes = KVPool.page_bytes(mc.num_layers, cache.page_size, mc.num_kv_heads,
                                       mc.head_dim, kv_dtype)
        budget = cache.kv_cache_memory
        if isinstance(budget, float):
            budget = int(budget * available_memory_bytes(self.device))
        num_pages = budget // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes is less than one page "
                             f"({page_bytes} bytes)")
        self.pool = KVPool(mc.num_layers, num_pages, cache.page_size, mc.num_kv_heads,
                           mc.head_dim, kv_dtype, self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.pool.k[i], self.pool.v[i]
        logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s)", num_pages,
                    cache.page_size, self.pool.capacity_tokens, self.pool.num_bytes / 2**30,
                    str(kv_dtype).removeprefix("torch."))
        tokenizer = checkpoint.tokenizer
        eos = tokenizer.eos_token_ids if tokenizer is not None else list(mc.eos_token_ids)
        self.sampler = Sampler(self.device, config.seed, eos)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests' new tokens into one batch."""
        page_size = self.pool.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens, seq_lens, logits_indices, sampled = [0], [], [], []
        for i, (request, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            start = request.num_computed_tokens
            end = start + n
            input_ids += request.token_ids(start, end)
            positions += range(start, end)
            table = request.page_table
            slots += [table[p // page_size].page_id * page_size + p % page_size
                      for p in range(start, end)]
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(end)
            if end == request.num_tokens:
                logits_indices.append(cu_seqlens[-1] - 1)
                sampled.append(i)
        max_pages = max(len(r.page_table) for r in out.requests)
        page_table = [[ref.page_id for ref in r.page_table] + [0] * (max_pages - len(r.page_table))
                      for r in out.requests]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            page_table=tensor(page_table, torch.int32),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            max_query_len=max(out.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta,
                          tensor(logits_indices, torch.int64), sampled, cu_seqlens)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of every new token: [num_tokens, hidden]."""
        with ops.use(self.backend):
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with ops.use(self.backend):
            return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: sample for the requests that reached their last token, and compute the
        log-probabilities they asked for."""
        inputs = self.prepare(out)
        hidden = self.forward(inputs)
        result = StepResult(inputs.sampled)
        if inputs.sampled:
            logits = self.compute_logits(hidden[inputs.logits_indices])
            requests = [out.requests[i] for i in inputs.sampled]
            tokens = self.sampler(logits, requests)
            result.tokens = tokens.tolist()
            wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
            if wanted:
                rows = torch.tensor(wanted, device=logits.device)
                entries = token_logprobs(logits[rows], tokens[rows],
                                         [requests[i].params.logprobs for i in wanted])
                result.logprobs = dict(zip(wanted, entries))
        for i, (request, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            p = request.params
            if p.prompt_logprobs is not None or p.prompt_logprobs_tensor:
                scored = self._score_prompt(request, n, hidden, inputs.cu_seqlens[i])
                if scored is not None:
                    result.prompt_logprobs[i] = scored
        return result

    def _score_prompt(self, request: Request, num_new: int, hidden: torch.Tensor,
                      row: int) -> PromptScores | None:
        """Log-probabilities of the prompt tokens this chunk predicts (the hidden state at
        position p scores prompt token p + 1), for tokens start+1 .. in order."""
        start = request.num_computed_tokens
        end = min(start + num_new, request.num_prompt_tokens - 1)
        if end <= start:
            return None
        p = request.params
        scores = PromptScores(start + 1, [] if p.prompt_logprobs is not None else None)
        rows = []
        for chunk in range(start, end, _LOGITS_ROWS):  # bound the [rows, vocab] logits
            stop = min(chunk + _LOGITS_ROWS, end)
            logits = self.compute_logits(hidden[row + chunk - start:row + stop - start])
            if scores.entries is not None:
                targets = torch.tensor(request.prompt_token_ids[chunk + 1:stop + 1],
                                       device=logits.device)
                scores.entries += token_logprobs(logits, targets,
                                                 [p.prompt_logprobs] * (stop - chunk))
            if p.prompt_logprobs_tensor:
                rows.append(logits.log_softmax(dim=-1))
        if rows:
            scores.tensor = torch.cat(rows)
        return scores
