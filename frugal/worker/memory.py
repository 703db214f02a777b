"""How much device memory the KV pool may take (see CacheConfig), measured with a dummy step;
and dummy prompt steps that compile the kernels before the first request."""

from __future__ import annotations

import logging
import time
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from frugal import ops
from frugal.config import EngineConfig, available_memory_bytes
from frugal.layers.attention import AttentionMetadata
from frugal.worker.kv_spec import KVSpec
from frugal.worker.step import LOGITS_ROWS

if TYPE_CHECKING:
    from frugal.worker.model_runner import ModelRunner

logger = logging.getLogger("frugal")


def kv_budget(runner: ModelRunner, spec: KVSpec, config: EngineConfig, graphs: bool,
              prompt_tokens: int = 0) -> int:
    """Bytes for the KV pool (see CacheConfig); graphs: decode graphs will be captured;
    prompt_tokens: and prompt graphs of up to that many tokens (worker.prompt_graphs)."""
    budget = config.cache.kv_cache_memory
    if isinstance(budget, float):
        return int(budget * available_memory_bytes(runner.device))
    if budget is not None:
        return budget
    if not runner.device.startswith("cuda"):
        return 2 * 2**30
    activations = profile_step(runner, spec, config)
    free, total = torch.cuda.mem_get_info(torch.device(runner.device))
    graph_bytes = 0
    if graphs:  # their static logits, plus a margin for the captured activations
        itemsize = torch.empty((), dtype=runner.dtype).element_size()
        graph_bytes = (config.cuda_graph_max_bs * runner.model_config.vocab_size * itemsize
                       + 2**29)
        if prompt_tokens:  # their logits, and their own copy of their largest step's peak
            # (measured: a quantized layer's dequantized weight does not scale with tokens)
            requests = min(config.scheduler.max_num_seqs, prompt_tokens)
            graph_bytes += (requests * runner.model_config.vocab_size * itemsize
                            + profile_step(runner, spec, config, prompt_tokens))
    budget = int(config.cache.gpu_memory_utilization * total) - (total - free)
    budget -= activations + graph_bytes
    logger.info("GPU memory: %.1f GiB total, %.1f GiB in use (weights), %.2f GiB peak "
                "activations, %.2f GiB for graphs -> %.1f GiB for the KV cache at "
                "gpu_memory_utilization %.2f", total / 2**30, (total - free) / 2**30,
                activations / 2**30, graph_bytes / 2**30, budget / 2**30,
                config.cache.gpu_memory_utilization)
    if budget <= 0:
        raise ValueError("gpu_memory_utilization: "
                         f"{config.cache.gpu_memory_utilization} leaves no memory for the KV "
                         "cache after the weights and activations")
    return budget


@torch.inference_mode()
def profile_step(runner: ModelRunner, spec: KVSpec, config: EngineConfig,
                 tokens: int | None = None) -> int:
    """Peak activation bytes of the largest step: the step's token budget (or `tokens`) of new
    tokens of one request, and logits for max_num_seqs rows. Runs against a one-page scratch
    cache (spec in the activation dtype) with every store skipped."""
    mc = runner.model_config
    tokens = tokens or config.resolved_batched_tokens()
    page_size = config.cache.page_size
    runner.bind(spec.unquantized(mc, runner.dtype).pool(1, runner.device))
    device = torch.device(runner.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
            page_table=torch.zeros(1, -(-tokens // page_size), dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([tokens], dtype=torch.int32),
            max_query_len=tokens, max_seq_len=tokens)
        ids = torch.zeros(tokens, dtype=torch.int64)
        positions = torch.arange(tokens) % mc.max_position_embeddings  # rotary table rows
        rows = min(tokens, max(config.scheduler.max_num_seqs, LOGITS_ROWS))
        with ops.use(runner.backend):
            hidden = runner.run_model(ids, positions, meta)
            runner.compute_logits(hidden[:rows]).log_softmax(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    runner.bind(None)
    del hidden, meta
    torch.cuda.empty_cache()
    return peak


# Dummy prompt steps run at start-up, as (decodes, new tokens of one prompt): every launch of the
# prompt attention kernel (its blocks of rows are picked by the prompt's length: see
# ops.triton.attention._extend_launch), a decode beside a prompt, and matmuls of up to 16 and of
# more rows (the quantized weights' kernels compile a variant per block of rows). warm_up adds
# steps of every power of two from 128 tokens up to the step budget, and of the budget itself:
# the blocks of every kernel that picks them by size (the sorted MoE GEMMs' tiles are tuned per
# power of two of slots, ops.triton.moe_configs; their 64-row blocks start above 16 slots an
# expert: 768 tokens of Kimi K2).
WARM_UP_STEPS = ((0, 2), (0, 16), (0, 32), (0, 64), (1, 16))


def warm_up_steps(budget: int) -> tuple[tuple[int, int], ...]:
    """WARM_UP_STEPS, then one prompt of each power of two from 128 below budget, and of
    budget (0: none of these)."""
    ladder = [n for n in (128 << i for i in range(32)) if n < budget]
    return WARM_UP_STEPS + tuple((0, n) for n in ladder + [budget]
                                 if n > max(t for _, t in WARM_UP_STEPS))


@torch.inference_mode()
def warm_up(runner: ModelRunner, budget: int = 0) -> None:
    """Run warm_up_steps(budget) (budget: the step budget in tokens) against the bound cache, and
    the sampler's argmax over logits in the model's dtype and in fp32 (greedy rows, then the
    sampled rows' race): Triton compiles a kernel variant on first use, and a compile in the
    middle of serving stalls every running request for ~0.3-1 s."""
    start = time.perf_counter()
    dummy_steps(runner, warm_up_steps(budget))
    vocab = runner.model_config.vocab_size
    for dtype in dict.fromkeys((runner.dtype, torch.float32)):
        runner.sampler.argmax(torch.zeros(2, vocab, dtype=dtype, device=runner.device))
    if runner.device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(runner.device))
        torch.cuda.empty_cache()  # (the ladder's cached blocks back before graphs capture)
    logger.info("prompt kernels warmed up in %.1f s", time.perf_counter() - start)


@torch.inference_mode()
def dummy_steps(runner: ModelRunner, steps) -> None:
    """Run steps [(decodes, new tokens of one prompt)] against the bound cache: every request
    reads page 0 and nothing is stored."""
    mc, device = runner.model_config, torch.device(runner.device)
    with torch.device(device), ops.use(runner.backend):
        for decodes, n in steps:
            lens = [1] * decodes + [n]
            tokens = sum(lens)
            meta = AttentionMetadata(
                slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
                page_table=torch.zeros(len(lens), -(-n // runner.pool.page_size),
                                       dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, *accumulate(lens)], dtype=torch.int32),
                seq_lens=torch.full((len(lens),), n, dtype=torch.int32),
                max_query_len=n, max_seq_len=n, num_decodes=decodes)
            runner.run_model(torch.zeros(tokens, dtype=torch.int64),
                             torch.arange(tokens) % mc.max_position_embeddings, meta)
