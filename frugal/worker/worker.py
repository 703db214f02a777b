"""A Worker: one device's share of the model, built in named phases; its runner runs the steps.

Start-up reads as a checklist: bind the device, build and load the model (quantized and packed
for the backend's kernels), find the FP8 KV scales (the checkpoint's, a file's, or calibrated
on the model), measure what memory is left and size the KV pool to it, create and bind the pool,
then compile the prompt kernels and capture the decode graphs. Under tensor parallelism every
rank builds the same Worker over its share of the model (worker.ranks); the others then mirror
rank 0's model calls. The logical KV (which page holds what) is not the worker's: the engine's
scheduler owns it (core.kv_cache_manager), and hands the device each step's tag changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import replace

import torch

from frugal import ops
from frugal.config import EngineConfig
from frugal.layers.attention import graph_capture_blocker, prompt_graph_blocker
from frugal.layers.linear import quantize_layers
from frugal.layers.moe import fuse_shared_experts, quantize_moe
from frugal.loader import Checkpoint
from frugal.models.registry import model_class
from frugal.parallel import SINGLE, Parallel
from frugal.quant.experts import Fp8Experts
from frugal.quant.fp8 import Fp8Weight
from frugal.worker import kv_check, kv_scales
from frugal.worker.kv_check import KVCheck
from frugal.worker.kv_scales import KVScales
from frugal.worker.kv_spec import KVSpec
from frugal.worker.memory import kv_budget, warm_up
from frugal.worker.model_runner import ModelRunner
from frugal.worker.sampler import Sampler

logger = logging.getLogger("frugal")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Worker:
    """Owns this device's model, KV pool and runner (parallel: this process's rank).

    After __init__: pool holds num_pages pages of kv_spec, bound to the model's attention
    layers; runner runs steps over it; max_model_len is what the pool and the model allow."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint,
                 parallel: Parallel = SINGLE) -> None:
        self.config, self.parallel = config, parallel
        self.model_config = mc = checkpoint.config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(mc)
        self.backend = ops.load(config.resolved_ops_backend())
        self.init_device()
        self.load_model(checkpoint)
        self.kv_spec = KVSpec.of(mc, config.cache, self.dtype, parallel)
        scales = self.find_kv_scales(checkpoint)
        self.kv_check = self.check_kv_cache(checkpoint, scales)
        self.init_cache(self.determine_num_pages(), scales)
        self.warm_up()
        # built: rank 0's model calls are broadcast to the other ranks from now on
        self.runner.leads = self.parallel.size > 1 and self.parallel.rank == 0

    # -- phases ------------------------------------------------------------------------------

    def init_device(self) -> None:
        if self.device.startswith("cuda"):
            # cuBLASLt picks faster kernels for the decode GEMMs at batch 64 (6.18 -> 6.00 ms
            # per step for Llama-3.1-8B on the H200) and the same at batch 1
            torch.backends.cuda.preferred_blas_library("cublaslt")

    def load_model(self, checkpoint: Checkpoint) -> None:
        """Build the model on the device, load its weights, quantize what --quantization asks,
        pack quantized weights for the backend's kernels; then the runner over it."""
        mc, config, start = self.model_config, self.config, time.perf_counter()
        if mc.moe is not None and not config.shared_experts_fusion:
            mc = self.model_config = replace(mc, moe=replace(mc.moe, fuse_shared=False))
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = model_class(mc)(mc, self.parallel)
        checkpoint.load_into(self.model)
        fuse_shared_experts(self.model)
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
                module.qgate_up = self.backend.pack_experts(module.qgate_up, self.dtype)
                module.qdown = self.backend.pack_experts(module.qdown, self.dtype)
        self.weights_quantization = "+".join(sorted(kinds)) or "none"
        self.backend.configure(kinds)  # launch settings for these weights (see ops.triton.launch)
        logger.info("loaded %s (%s, %d layers) in %.1f s as %s on %s, %s ops", mc.architecture,
                    type(checkpoint).__name__, mc.num_layers, time.perf_counter() - start,
                    str(self.dtype).removeprefix("torch."), self.device,
                    self.backend.__name__.rsplit(".", 1)[-1])
        tokenizer = checkpoint.tokenizer
        eos = tokenizer.eos_token_ids if tokenizer is not None else list(mc.eos_token_ids)
        argmax = self.backend.argmax if self.device.startswith("cuda") else None
        self.runner = ModelRunner(config, self.model, self.backend,
                                  Sampler(self.device, config.seed, eos, argmax), self.parallel)

    def find_kv_scales(self, checkpoint: Checkpoint) -> KVScales | None:
        """FP8 caches only: the checkpoint's k_scale/v_scale, else --kv-scales-path, else
        calibrated now on the model (see worker.kv_scales)."""
        if not self.config.cache.fp8:
            return None
        if self.parallel.size > 1:
            raise ValueError("kv_cache_dtype: an FP8 cache is not split across ranks yet "
                             "(tensor_parallel_size > 1)")
        return kv_scales.resolve(self.runner, self.kv_spec,
                                 getattr(self.model, "kv_scales_found", {}),
                                 checkpoint.tokenizer)

    def check_kv_cache(self, checkpoint: Checkpoint, scales: KVScales | None) -> KVCheck | None:
        """Quantized caches only, unless skipped: how far the format moves the next-token
        distribution (see worker.kv_check; raises ValueError above --kv-cache-max-kl)."""
        cache = self.config.cache
        if not cache.quantized or not cache.kv_cache_check:
            return None
        return kv_check.check(self.runner, self.kv_spec, checkpoint.tokenizer,
                              None if scales is None else scales.values, cache.kv_cache_max_kl)

    def determine_num_pages(self) -> int:
        """Pages of kv_spec the KV budget holds (the same on every rank)."""
        budget = kv_budget(self.runner, self.kv_spec, self.config, self.uses_graphs,
                           self.prompt_graph_tokens)
        num_pages = self.parallel.fewest(budget // self.kv_spec.page_bytes, self.device)
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: {budget} bytes is less than one page "
                             f"({self.kv_spec.page_bytes} bytes)")
        return num_pages

    def init_cache(self, num_pages: int, scales: KVScales | None) -> None:
        mc, cache = self.model_config, self.config.cache
        # (a disaggregated worker's pool: other workers on this host may map it, disagg.direct)
        self.pool = self.kv_spec.pool(num_pages, self.device, shareable=(
            self.config.kv_role is not None and self.config.kv_transport == "auto"))
        if scales is not None:
            self.pool.scales = scales.values.to(self.device)
            self.pool.scales_source = scales.source
        self.runner.bind(self.pool)
        # tokens per byte against a cache in the activation dtype (FP8 under bf16: 2.0)
        self.kv_capacity_ratio = (self.kv_spec.unquantized(mc, self.dtype).page_bytes
                                  / self.kv_spec.page_bytes)
        logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s: %.2fx the tokens "
                    "of %s)", num_pages, cache.page_size, self.pool.capacity_tokens,
                    self.pool.num_bytes / 2**30, self.pool.name,
                    self.kv_capacity_ratio, str(self.dtype).removeprefix("torch."))
        wanted = min(self.config.scheduler.max_model_len or mc.max_position_embeddings,
                     mc.max_position_embeddings)
        self.max_model_len = min(wanted, self.pool.capacity_tokens)
        if self.max_model_len < wanted and self.parallel.rank == 0:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds no more",
                           wanted, self.max_model_len)

    def warm_up(self) -> None:
        """Compile the prompt kernels (a compile mid-serving stalls every request), and capture
        the decode graphs (and prompt graphs, if asked for) when the device, the backend and
        the model's attention allow them."""
        if self.device.startswith("cuda"):
            warm_up(self.runner, self.config.resolved_batched_tokens())
        c = self.config
        if c.prompt_graph_max_tokens and (why := prompt_graph_blocker(self.model_config)):
            logger.info("steps with prompt tokens run eagerly: %s", why)
        self.runner.enable_graphs(self.uses_graphs, min(c.cuda_graph_max_bs,
                                                        c.scheduler.max_num_seqs),
                                  self.max_model_len, self.prompt_graph_tokens)

    # -- what the engine asks ----------------------------------------------------------------

    @property
    def prompt_graph_tokens(self) -> int:
        """The most tokens of a step with prompt tokens replayed from a graph (0: none; with
        decode graphs only, for an attention backend whose prompts allow it)."""
        c = self.config
        if not self.uses_graphs or prompt_graph_blocker(self.model_config) is not None:
            return 0
        return min(c.prompt_graph_max_tokens, c.resolved_batched_tokens())

    @property
    def uses_graphs(self) -> bool:
        """Decode steps replayed from CUDA graphs: on a device and backend that capture them,
        for an attention backend that allows it (layers.attention: its graph_capture), in the
        engine's own process only (the other ranks' collectives are made one call at a time)."""
        return (self.device.startswith("cuda") and not self.config.enforce_eager
                and self.backend.CUDA_GRAPHS and self.parallel.size == 1
                and graph_capture_blocker(self.model_config) is None)

    def kv_key(self) -> str:
        """What makes the KV of the same tokens differ between engines (the root of the prefix
        cache's hashes): checkpoint, weights variant, layers, dtypes, FP8 KV scales."""
        c, pool = self.config, self.pool
        scales = "" if pool.scales is None else hashlib.sha256(
            pool.scales.float().cpu().numpy().tobytes()).hexdigest()
        return "|".join(map(str, (c.model, c.load_format, c.seed, self.weights_quantization,
                                  c.num_layers, self.dtype, pool.name, scales)))
