"""Builds the model and its KV pool, turns a scheduled step into tensors, runs it, samples."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import torch

from frugal import ops
from frugal.config import KV_DTYPES, EngineConfig
from frugal.core.page_allocator import PageAllocator
from frugal.core.scheduler import SchedulerOutput
from frugal.layers.attention import AttentionMetadata
from frugal.layers.linear import quantize_layers
from frugal.layers.moe import quantize_moe
from frugal.loader import Checkpoint
from frugal.models.registry import model_class
from frugal.parallel import SINGLE, Parallel
from frugal.quant.experts import Fp8Experts
from frugal.quant.fp8 import Fp8Weight
from frugal.worker import kv_scales
from frugal.worker.cuda_graph import DecodeGraphs
from frugal.worker.kv_pool import KVPool
from frugal.worker.memory import kv_budget, warm_up
from frugal.worker.ranks import to_device
from frugal.worker.sampler import Sampler, token_logprobs
from frugal.worker.step import Launched, StepResult, failures, score_prompt, scores_prompt
from frugal.worker.step_inputs import Pending, StepInputs, prepare

logger = logging.getLogger("frugal")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    """Owns the model, the KV pool and the sampler on one device.

    parallel: this process's rank under tensor parallelism. Rank 0's runner is the engine's:
    once built, before each model call it broadcasts the call to the other ranks' runners
    (engine.worker), which make it too, so the collectives inside the model meet. While being
    built, every rank makes the same calls (memory profile, warm-up) on its own."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint,
                 parallel: Parallel = SINGLE) -> None:
        self.config = config
        self.parallel = parallel
        self.leads = False  # rank 0, built: its model calls are broadcast first
        self.device = config.resolved_device()
        self.model_config = mc = checkpoint.config
        self.dtype = config.resolved_dtype(mc)
        self.backend = ops.load(config.resolved_ops_backend())
        if self.device.startswith("cuda"):
            # cuBLASLt picks faster kernels for the decode GEMMs at batch 64 (6.18 -> 6.00 ms
            # per step for Llama-3.1-8B on the H200) and the same at batch 1
            torch.backends.cuda.preferred_blas_library("cublaslt")
        start = time.perf_counter()
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = model_class(mc)(mc, parallel)
        checkpoint.load_into(self.model)
        if config.quantization != "none":
            quantize_layers(self.model, config.quantization)
            quantize_moe(self.model, config.quantization)
        kinds = set()  # the quantized weights loaded (from the checkpoint or quantized here)
        for module in self.model.modules():  # into the layout the backend's kernels read
            if getattr(module, "qweight", None) is not None:
                kinds.add("fp8" if isinstance(module.qweight, Fp8Weight) else "int4")
                module.qweight = self.backend.pack_weight(module.qweight, self.dtype)
            if getattr(module, "qgate_up", None) is not None:  # routed experts (layers.moe)
                kinds.add("fp8" if isinstance(module.qgate_up, Fp8Experts) else "int4")
        self.weights_quantization = "+".join(sorted(kinds)) or "none"
        triton_ops = self.backend.__name__.endswith("triton")
        if triton_ops:  # see ops.triton.launch
            from frugal.ops.triton.launch import set_default
            set_default("wait" if kinds else "trigger")
        logger.info("loaded %s (%s, %d layers) in %.1f s as %s on %s, %s ops", mc.architecture,
                    type(checkpoint).__name__, mc.num_layers, time.perf_counter() - start,
                    str(self.dtype).removeprefix("torch."), self.device,
                    self.backend.__name__.rsplit(".", 1)[-1])
        tokenizer = checkpoint.tokenizer
        eos = tokenizer.eos_token_ids if tokenizer is not None else list(mc.eos_token_ids)
        argmax = None
        if triton_ops and self.device.startswith("cuda"):
            from frugal.ops.triton.sampling import argmax
        self.sampler = Sampler(self.device, config.seed, eos, argmax)
        self.graphs: DecodeGraphs | None = None
        self.integrity = False  # (the FP8 calibration below runs steps unchecked)
        self._unread: list[Launched] = []  # steps that sampled nothing, status not yet read
        cache = config.cache
        kv_dtype = self.dtype if cache.kv_cache_dtype == "auto" else KV_DTYPES[cache.kv_cache_dtype]
        scales = None
        if cache.fp8 and parallel.size > 1:
            raise ValueError("kv_cache_dtype: an FP8 cache is not split across ranks yet "
                             "(tensor_parallel_size > 1)")
        if cache.fp8:
            scales = kv_scales.resolve(self, getattr(self.model, "kv_scales_found", {}),
                                       tokenizer)
        width = mc.cache_width(cache.fp8)
        # this rank's KV heads (LlamaAttention); MLA's latent is replicated (layers.mla)
        kv_heads = mc.num_kv_heads if mc.mla is not None else parallel.part(mc.num_kv_heads)[1]
        page_bytes = KVPool.page_bytes(mc.num_layers, cache.page_size, kv_heads, width,
                                       kv_dtype, mc.kv_parts)
        # (MLA attention runs PyTorch ops with host-side shapes: no graphs for it yet)
        self.use_graphs = (self.device.startswith("cuda") and not config.enforce_eager
                           and triton_ops and mc.mla is None and parallel.size == 1)
        budget = kv_budget(self, config)
        num_pages = budget // page_bytes
        num_pages = parallel.fewest(num_pages, self.device)  # (the same pages on every rank)
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes is less than one page "
                             f"({page_bytes} bytes)")
        self.pool = KVPool(mc.num_layers, num_pages, cache.page_size, kv_heads, width,
                           kv_dtype, self.device, mc.kv_parts)
        self.allocator = PageAllocator(num_pages)
        if scales is not None:
            self.pool.scales = scales.values.to(self.device)
            self.pool.scales_source = scales.source
        self.bind_cache(self.pool)
        if self.device.startswith("cuda"):
            warm_up(self)
        # tokens per byte against a cache in the activation dtype (FP8 under bf16: 2.0)
        self.kv_capacity_ratio = KVPool.page_bytes(mc.num_layers, cache.page_size,
                                                   kv_heads, mc.head_dim,
                                                   self.dtype, mc.kv_parts) / page_bytes
        logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s: %.2fx the tokens "
                    "of %s)", num_pages, cache.page_size, self.pool.capacity_tokens,
                    self.pool.num_bytes / 2**30, str(kv_dtype).removeprefix("torch."),
                    self.kv_capacity_ratio, str(self.dtype).removeprefix("torch."))
        self.max_model_len = min(config.scheduler.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings, self.pool.capacity_tokens)
        self._graph_sets: dict[bool, DecodeGraphs] = {}
        self.set_integrity(cache.kv_integrity)
        self.leads = parallel.size > 1 and parallel.rank == 0

    def kv_key(self) -> str:
        """What makes the KV of the same tokens differ between engines (the root of the prefix
        cache's hashes): checkpoint, weights variant, layers, dtypes, FP8 KV scales."""
        c, pool = self.config, self.pool
        scales = "" if pool.scales is None else hashlib.sha256(
            pool.scales.float().cpu().numpy().tobytes()).hexdigest()
        return "|".join(map(str, (c.model, c.load_format, c.seed, self.weights_quantization,
                                  c.num_layers, self.dtype, pool.dtype, scales)))

    def set_integrity(self, on: bool) -> None:
        """Turn the integrity check on or off between steps (benchmarks compare the two in one
        process). Each mode has its own decode graphs, captured on first use."""
        if on and not self.integrity:  # the device tags went stale while off
            self.allocator.take_tag_updates()
            self.pool.tags.copy_(torch.tensor(self.allocator.tags, dtype=torch.int32))
        self.integrity = on
        if self.use_graphs:
            if on not in self._graph_sets:
                c = self.config
                self._graph_sets[on] = DecodeGraphs(
                    self.model, self.backend, min(c.cuda_graph_max_bs, c.scheduler.max_num_seqs),
                    self.max_model_len, c.cache.page_size, self.model_config.vocab_size,
                    self.dtype, self.device, self.pool.tags if on else None)
            self.graphs = self._graph_sets[on]

    def bind_cache(self, pool: KVPool) -> None:
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = pool.k[i], pool.v[i]
            attn.kv_scales = None if pool.scales is None else pool.scales[i]

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
        updates = self.allocator.take_tag_updates() if check else None
        try:
            inputs = prepare(out, self.pool.page_size, self.device, pending=pending, check=check,
                             tag_updates=updates)
        except BaseException:
            if updates:  # (the device never got them: they go with the next step)
                self.allocator.return_tag_updates(updates)
            raise
        step = Launched(out, inputs, starts=[r.num_computed_tokens for r in out.requests])
        scoring = any(map(scores_prompt, out.requests, step.starts))
        if inputs.tag_updates is not None:
            self.pool.tags.index_copy_(0, *inputs.tag_updates)
        if self.graphs is not None and self.graphs.fits(inputs) and not scoring:
            logits, step.status = self.graphs.run(inputs)
            if len(inputs.sampled) < inputs.num_requests:
                logits = logits[inputs.logits_indices]
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
