"""The start-up check of a quantized KV cache: how far it moves the next-token distribution.

Built-in texts (TEXTS: prose, code, arithmetic, a list, a chat turn) are read teacher-forced,
in one prefill step, into a cache in the activation dtype and into a cache of the chosen format,
each token reading the ones before it through the cache as decode steps do (a prompt step would
read its own tokens' K/V as computed: SamplingParams.prompt_from_cache); at every position, the
KL divergence of the quantized cache's next-token distribution from the reference's, and
whether their top-1 tokens agree. Prefill only: a few seconds on a CPU for a small model. Small
models with narrow heads and outlier-heavy models feel e4m3's 3-bit mantissa (answers change),
large ones rarely do: above WARN_KL the check says so loudly and measures the formats that keep
more precision, naming the best; CacheConfig.kv_cache_max_kl refuses to start above a KL of
one's choosing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from frugal.core.page_allocator import PageRef
from frugal.core.page_table import PageTable
from frugal.core.scheduler import SchedulerOutput
from frugal.request import Request, SamplingParams
from frugal.worker.kv_spec import KVSpec
from frugal.worker.step import LOGITS_ROWS

if TYPE_CHECKING:
    from frugal.worker.model_runner import ModelRunner

logger = logging.getLogger("frugal")
WARN_KL = 0.005  # mean KL above which a format is said to change answers
BETTER = ("int8_per_token_head", "fp8_v")  # formats that keep more bits, best last
TEXTS = [
    "A refrigerator keeps food cold by moving heat from inside the box to the room outside. "
    "A refrigerant is compressed, which heats it; it gives that heat away through the coils at "
    "the back, then expands through a valve and turns cold, taking heat from the inside.",
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "17 multiplied by 23: 17 x 20 = 340 and 17 x 3 = 51, so 17 x 23 = 340 + 51 = 391. "
    "Check: 391 / 23 = 17. The answer is 391.",
    "Ten animals of the ocean: 1. the blue whale, the largest animal ever; 2. the octopus, "
    "with three hearts; 3. the sea otter, which holds hands while sleeping; 4. the clownfish; "
    "5. the great white shark; 6. the dolphin; 7. the sea turtle; 8. the jellyfish.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris, on the "
    "Seine. It is the largest city of the country and has been its capital for most of its "
    "history.\nUser: And of Spain?\nAssistant: Madrid.",
]


@dataclass
class KVCheck:
    """One format against the activation dtype's cache, over num_tokens predicted tokens."""

    format: str
    kl_mean: float
    kl_max: float
    top1_agree: float  # fraction of positions
    num_tokens: int
    seconds: float

    def describe(self) -> str:
        return (f"{self.format}: mean KL {self.kl_mean:.5f} (max {self.kl_max:.3f}), top-1 "
                f"agreement {100 * self.top1_agree:.1f} % over {self.num_tokens} tokens")


def texts(runner: ModelRunner, tokenizer, which: list[str] = TEXTS) -> list[list[int]]:
    """Token ids of built-in texts (dummy weights, no tokenizer: fixed random ids, another
    seed for another list)."""
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in which]
    g = torch.Generator().manual_seed(0 if which is TEXTS else 1)
    return [torch.randint(runner.model_config.vocab_size, (64,), generator=g).tolist()
            for _ in which]


def scratch_requests(name: str, prompts: list[list[int]], page_size: int, generate: int = 0
                     ) -> tuple[list[Request], int]:
    """A request a prompt, with room for `generate` greedy tokens after it, on consecutive
    pages of a scratch pool from page 0: (the requests, the pages they take). Their prompts
    read one another through the cache (SamplingParams.prompt_from_cache), as decode steps
    would: what the check measures (calibration's cache is unquantized: the same to it)."""
    params = SamplingParams(max_tokens=max(generate, 1), temperature=0.0, ignore_eos=True,
                            prompt_from_cache=True)
    requests, first = [], 0
    for i, ids in enumerate(prompts):
        n = -(-(len(ids) + generate) // page_size)
        request = Request(f"{name}-{i}", None, list(ids), params, len(ids) + generate)
        request.page_table = PageTable(PageRef(p, 0) for p in range(first, first + n))
        requests.append(request)
        first += n
    return requests, first


@torch.inference_mode()
def log_probs(runner: ModelRunner, spec: KVSpec, prompts: list[list[int]],
              scales: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The prompts prefilled in one step into a fresh pool of spec (static FP8: with scales
    [num_layers, 2, num_kv_heads]); per prompt [len - 1, vocab] fp32 log-probabilities of
    tokens 1.. on the runner's device. The runner must have no pool bound, and has none after."""
    if runner.pool is not None or runner.graphs is not None:
        raise RuntimeError("kv_check: the runner is already bound to a pool")
    requests, num_pages = scratch_requests("kv-check", prompts, spec.page_size)
    pool = spec.pool(num_pages, runner.device)
    if scales is not None:
        pool.scales = scales.to(runner.device)
    out, start = [], 0
    runner.bind(pool)
    try:
        hidden = runner.forward(runner.prepare(
            SchedulerOutput(requests, [len(ids) for ids in prompts])))
        for ids in prompts:
            rows = [runner.compute_logits(hidden[s:min(s + LOGITS_ROWS, start + len(ids) - 1)])
                    for s in range(start, start + len(ids) - 1, LOGITS_ROWS)]
            out.append(torch.cat(rows).log_softmax(-1))
            start += len(ids)
    finally:
        runner.bind(None)
        del pool
        if runner.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def compare(name: str, mine: list[torch.Tensor], reference: list[torch.Tensor],
            seconds: float) -> KVCheck:
    """KL(reference || mine) per position (fp64) and top-1 agreement."""
    kl = torch.cat([(r.exp().double() * (r.double() - m.double())).sum(-1).clamp_min(0).cpu()
                    for m, r in zip(mine, reference)])
    agree = sum((m.argmax(-1) == r.argmax(-1)).sum().item() for m, r in zip(mine, reference))
    return KVCheck(name, kl.mean().item(), kl.max().item(), agree / kl.numel(), kl.numel(),
                   seconds)


def check(runner: ModelRunner, spec: KVSpec, tokenizer, scales: torch.Tensor | None,
          max_kl: float | None) -> KVCheck:
    """Measure spec's format against the activation dtype's cache (see the module docstring);
    log it, warn above WARN_KL naming a better format, raise ValueError above max_kl."""
    start = time.perf_counter()
    prompts = texts(runner, tokenizer)
    reference = log_probs(runner, spec.unquantized(runner.model_config, runner.dtype), prompts)
    result = compare(spec.name, log_probs(runner, spec, prompts, scales), reference,
                     time.perf_counter() - start)
    logger.info("KV cache check: %s (%.1f s)", result.describe(), result.seconds)
    if result.kl_mean > WARN_KL:
        others = [compare(name, log_probs(runner, other, prompts), reference, 0.0)
                  for name in BETTER if name != spec.name
                  for other in [_spec(runner, spec, name)] if other is not None]
        best = min(others, key=lambda c: c.kl_mean, default=None)
        advice = (f"; {best.describe()}: try --kv-cache-dtype {best.format}"
                  if best is not None and best.kl_mean < result.kl_mean else "")
        logger.warning("KV cache check: this model is sensitive to %s (mean KL %.5f > %g: "
                       "greedy answers will differ from the unquantized cache's)%s",
                       spec.name, result.kl_mean, WARN_KL, advice)
    if max_kl is not None and result.kl_mean > max_kl:
        raise ValueError(f"kv_cache_max_kl: {result.describe()}, above {max_kl:g}")
    return result


def _spec(runner: ModelRunner, spec: KVSpec, name: str) -> KVSpec | None:
    """spec in another format (None where the model cannot take it)."""
    cache = dataclasses.replace(runner.config.cache, kv_cache_dtype=name, kv_scales_path=None,
                                calibration_file=None, kv_cache_max_kl=None)
    try:
        other = KVSpec.of(runner.model_config, cache, runner.dtype, runner.parallel)
    except ValueError:
        return None
    return dataclasses.replace(other, page_size=spec.page_size)
