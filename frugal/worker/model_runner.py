"""Runs steps on one device: a scheduled step into tensors, the model, sampling, the results.

Built by worker.Worker over its model, with a KV pool bound (bind) and, where allowed, decode
graphs captured (enable_graphs). Knows nothing of which page holds what: a step's page tables
and tag changes come with it (core.scheduler.SchedulerOutput).
"""

from __future__ import annotations

from types import ModuleType

import torch

from frugal import ops
from frugal.config import EngineConfig
from frugal.core.scheduler import SchedulerOutput
from frugal.layers.attention import AttentionMetadata
from frugal.parallel import SINGLE, Parallel
from frugal.worker.cuda_graph import DecodeGraphs
from frugal.worker.kv_pool import KVPool
from frugal.worker.prompt_graphs import PromptGraphs
from frugal.worker.sampler import Sampler, token_logprobs
from frugal.worker.step import Launched, StepResult, failures, score_prompt, scores_prompt
from frugal.worker.step_inputs import Pending, StepInputs, prepare


def to_device(x, device: str):
    """Tensors (in tuples and AttentionMetadata) moved to device ("cpu" for a broadcast)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(to_device(v, device) for v in x)
    if isinstance(x, AttentionMetadata):
        return AttentionMetadata(**{k: to_device(v, device) for k, v in vars(x).items()})
    return x


class ModelRunner:
    """The model, the bound KV pool and the sampler on one device.

    parallel: this process's rank under tensor parallelism. Rank 0's runner is the engine's:
    once built (leads), before each model call it broadcasts the call to the other ranks'
    runners (worker.ranks), which make it too, so the collectives inside the model meet. While
    being built, every rank makes the same calls (memory profile, warm-up) on its own."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, backend: ModuleType,
                 sampler: Sampler, parallel: Parallel = SINGLE) -> None:
        self.config, self.model, self.backend, self.sampler = config, model, backend, sampler
        self.parallel = parallel
        self.leads = False  # rank 0, built: its model calls are broadcast first
        self.device = config.resolved_device()
        self.model_config = model.config
        self.dtype = config.resolved_dtype(self.model_config)
        self.pool: KVPool | None = None
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        self.integrity = False  # (FP8 calibration runs steps unchecked)
        self._graph_sets: dict[bool, tuple[DecodeGraphs, PromptGraphs | None]] = {}
        # (max_bs, max_model_len, prompt graphs' max tokens) with graphs on
        self._graph_args: tuple | None = None
        self._unread: list[Launched] = []  # steps that sampled nothing, status not yet read

    def bind(self, pool: KVPool | None) -> None:
        """Run against pool (None: none; the model's attention layers point at its pages)."""
        self.pool = pool
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = None if pool is None else pool.k[i]
            attn.v_cache = None if pool is None else pool.v[i]
            attn.kv_scales = None if pool is None or pool.scales is None else pool.scales[i]

    def enable_graphs(self, on: bool, max_bs: int, max_model_len: int,
                      prompt_tokens: int = 0) -> None:
        """Decode steps of up to max_bs requests from CUDA graphs, and steps with prompt tokens
        of up to prompt_tokens tokens (0: none; worker.prompt_graphs), captured now for the
        integrity setting in force (the other setting's on first use). Call once, bound."""
        self._graph_args = (max_bs, max_model_len, prompt_tokens) if on else None
        self.set_integrity(self.config.cache.kv_integrity)

    def set_integrity(self, on: bool, tags: list[int] | None = None) -> None:
        """Turn the integrity check on or off between steps (benchmarks compare the two in one
        process); tags: every page's current tag, when turning it on again (the device's copy
        went stale while it was off: core.kv_cache_manager.tags). Each mode has its own decode
        graphs, captured on first use."""
        if on and not self.integrity and tags is not None:
            self.pool.tags.copy_(torch.tensor(tags, dtype=torch.int32))
        self.integrity = on
        if self._graph_args is not None:
            if on not in self._graph_sets:
                max_bs, max_model_len, prompt_tokens = self._graph_args
                shape = (self.pool.page_size, self.model_config.vocab_size, self.dtype,
                         self.device, self.pool.tags if on else None)
                self._graph_sets[on] = (
                    DecodeGraphs(self.model, self.backend, max_bs, max_model_len, *shape),
                    PromptGraphs(self.model, self.backend, prompt_tokens,
                                 self.config.scheduler.max_num_seqs, max_model_len, *shape)
                    if prompt_tokens else None)
            self.graphs, self.prompt_graphs = self._graph_sets[on]

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        return prepare(out, self.pool.page_size, self.device)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of every new token: [num_tokens, hidden]."""
        return self.run_model(inputs.input_ids, inputs.positions, inputs.meta)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The model on one batch (the other ranks told first: see the class docstring)."""
        if self.leads:
            self.parallel.broadcast(("model", to_device((input_ids, positions, meta), "cpu")))
        with ops.use(self.backend):
            return self.model(input_ids, positions, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.leads:
            self.parallel.broadcast(("logits", hidden.cpu()))
        with ops.use(self.backend):
            return self.model.compute_logits(hidden)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step and wait for it (see launch and finish)."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, after: Launched | None = None) -> Launched:
        """Queue one step on the device, sampling included, without waiting for it.

        after: the step still in flight that this one follows (see can_follow): the tokens it
        samples are the pending tokens (Request.num_pending) of this step's inputs, gathered on
        the device.
        """
        check = self.integrity
        pending = None
        if after is not None and after.inputs.sampled:
            pending = Pending(after.tokens, {after.out.requests[i]: j
                                             for j, i in enumerate(after.inputs.sampled)})
        # (raises before the device gets out.tag_updates: the caller gives them back)
        inputs = prepare(out, self.pool.page_size, self.device, pending=pending, check=check,
                         tag_updates=out.tag_updates if check else None)
        step = Launched(out, inputs, starts=[r.num_computed_tokens for r in out.requests])
        scoring = any(map(scores_prompt, out.requests, step.starts))
        if inputs.tag_updates is not None:
            self.pool.tags.index_copy_(0, *inputs.tag_updates)
        if self.graphs is not None and self.graphs.fits(inputs) and not scoring:
            logits, step.status = self.graphs.run(inputs)
            if len(inputs.sampled) < inputs.num_requests:
                logits = logits[inputs.logits_indices]
        elif (self.prompt_graphs is not None and self.prompt_graphs.fits(inputs)
              and not scoring):
            logits, step.status = self.prompt_graphs.run(inputs)
        else:
            if check:
                step.status = self._check(inputs)
            hidden = self.forward(inputs)
            logits = self.compute_logits(hidden[inputs.logits_indices])
            if scoring:
                step.hidden = hidden  # (kept only when finish() scores prompt tokens with it)
        if inputs.sampled:
            sampling = [out.requests[i] for i in inputs.sampled]
            if any(r.params.logprobs is not None for r in sampling):
                step.logits = logits
            step.tokens = self.sampler(logits, sampling)
        if self.device.startswith("cuda") and (inputs.sampled or step.status is not None):
            # the device-to-host copies of a step (tokens and integrity status), one event
            for name in ("tokens", "status"):
                src = getattr(step, name)
                if src is not None:
                    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                    host.copy_(src, non_blocking=True)
                    setattr(step, "host_" + name, host)
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def _check(self, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.meta
        with ops.use(self.backend):
            return ops.check_kv_pages(meta.page_table, inputs.page_tags, self.pool.tags,
                                      meta.seq_lens, meta.cu_seqlens_q, meta.slot_mapping,
                                      self.pool.page_size)

    def can_follow(self, step: Launched) -> bool:
        """Whether the next step may be launched before this one's tokens are read: nothing
        needs this step's logits or hidden states later (log-probabilities, prompt scores: a
        captured graph's outputs are overwritten by the next replay)."""
        return all(r.params.logprobs is None and not scores_prompt(r, start)
                   for r, start in zip(step.out.requests, step.starts))

    def device_ok(self) -> bool:
        """Whether the device still runs work (after a step raised: a sticky CUDA error, such
        as an illegal address or a device-side assert, fails every later call)."""
        if not self.device.startswith("cuda"):
            return True
        try:
            torch.cuda.synchronize(self.device)
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:
            return False

    def forget_unread(self) -> None:
        """Drop the launched steps whose integrity status was never read (their requests were
        all finished after a step failed)."""
        self._unread = []

    @torch.inference_mode()
    def finish(self, step: Launched) -> StepResult:
        """Wait for a launched step's tokens; compute the log-probabilities it asked for."""
        out, inputs = step.out, step.inputs
        result = StepResult(inputs.sampled)
        if inputs.sampled:
            if step.done is not None:
                step.done.synchronize()
                result.tokens = step.host_tokens.tolist()
            else:
                result.tokens = step.tokens.tolist()
        if step.status is not None:
            # a step that sampled nothing is not waited for: its status is read once done (at
            # the latest with the next step that samples, which waits anyway)
            self._unread.append(step)
        waited = bool(inputs.sampled) or step.done is None
        unread = []
        for earlier in self._unread:
            if waited or earlier.done.query():
                result.failures += failures(earlier)
            else:
                unread.append(earlier)
        self._unread = unread
        if inputs.sampled:
            requests = [out.requests[i] for i in inputs.sampled]
            wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
            if wanted:
                rows = torch.tensor(wanted, device=step.logits.device)
                entries = token_logprobs(step.logits[rows], step.tokens[rows],
                                         [requests[i].params.logprobs for i in wanted])
                result.logprobs = dict(zip(wanted, entries))
        for i, (request, start) in enumerate(zip(out.requests, step.starts)):
            if scores_prompt(request, start):
                scored = score_prompt(self.compute_logits, request, start,
                                      out.num_new_tokens[i], step.hidden, inputs.cu_seqlens[i])
                if scored is not None:
                    result.prompt_logprobs[i] = scored
        return result
