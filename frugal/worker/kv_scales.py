"""Scales of an FP8 KV cache: one per layer, KV head and K/V, values [num_layers, 2, num_kv_heads]
(MLA: one KV head, K and V the same latent rows; a DSA index key has its own scale a token).

The cache stores x / scale saturated to ±448 (float8_e4m3fn's largest value), so a scale is the
amax of what it covers over 448. Where they come from, in order: the checkpoint's k_scale /
v_scale tensors (compressed-tensors and ModelOpt write them per tensor or per head); a file from
`frugal calibrate-kv` (--kv-scales-path); else a calibration at start-up: the model reads
built-in texts (or --calibration-file), prefill only, into a small cache in its activation
dtype, and the amax of every head's K and V there, times HEADROOM, sets its scales. Never a
silent 1.0. The headroom keeps values past the calibration set from clamping (chat text
exceeds a calibrated amax by up to 1.6x); a power of two, it costs e4m3 no mantissa bit, only
range at the subnormal end.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from frugal.config import ModelConfig
from frugal.core.scheduler import SchedulerOutput
from frugal.ops.torch_ref.attention import FP8_MAX
from frugal.request import Request
from frugal.worker.kv_check import scratch_requests, texts
from frugal.worker.kv_spec import KVSpec

if TYPE_CHECKING:
    from frugal.worker.model_runner import ModelRunner

logger = logging.getLogger("frugal")
FORMAT = "frugal-kv-scales/1"
# Chat prompts in varied registers (code, arithmetic, lists, prose): what `frugal quantize`
# calibrates GPTQ on.
PROMPTS = [
    "Explain in a few paragraphs how a refrigerator keeps food cold.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What is 17 multiplied by 23? Show the steps.",
    "List ten animals that live in the ocean and one fact about each.",
    "Once upon a time, in a village at the edge of a great forest,",
    "Summarize the causes of the French Revolution for a high-school student.",
    "Translate to French: The weather is nice today and we are going to the market.",
    "Give three tips for writing clear technical documentation.",
]
HEADROOM = 2.0
# What start-up calibration reads (prefill only): registers like the check's (worker.kv_check),
# other texts, so that the check measures static scales out of sample.
TEXTS = [
    "The French Revolution began in 1789, when debt, bad harvests and the privileges of the "
    "nobility and clergy drove the Third Estate to declare itself a National Assembly. The "
    "storming of the Bastille in July made it a popular revolt.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
    "Solve 3x + 7 = 25. Subtract 7 from both sides: 3x = 18. Divide by 3: x = 6. Check: "
    "3 * 6 + 7 = 18 + 7 = 25.",
    "User: Give me three tips for clear technical writing.\nAssistant: 1. Say who does what, "
    "in the active voice. 2. One idea a sentence. 3. Show an example before the rule.\nUser: "
    "Thanks! Translate 'good morning' to French.\nAssistant: Bonjour.",
]
FILE_CHUNK, FILE_CHUNKS = 512, 8  # --calibration-file: up to 8 windows of 512 tokens


@dataclass
class KVScales:
    values: torch.Tensor  # [num_layers, 2, num_kv_heads] fp32, > 0; [:, 0] K, [:, 1] V
    source: str

    def describe(self) -> str:
        k, v = self.values[:, 0], self.values[:, 1]
        return (f"{self.source}; K scales {k.min().item():.3g}..{k.max().item():.3g}, "
                f"V scales {v.min().item():.3g}..{v.max().item():.3g}")

    def save(self, path: str, model: str) -> None:
        data = {"format": FORMAT, "model": model, "source": self.source,
                "num_layers": self.values.shape[0], "num_kv_heads": self.values.shape[2],
                "k_scale": self.values[:, 0].tolist(), "v_scale": self.values[:, 1].tolist()}
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def load(path: str, mc: ModelConfig) -> KVScales:
    """Scales written by `frugal calibrate-kv`, checked against the model's shape."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"kv_scales_path: cannot read {path!r}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"kv_scales_path: {path!r} is not a {FORMAT} file")
    want = (mc.num_layers, mc.num_kv_heads)
    rows = []
    for kind in ("k_scale", "v_scale"):
        try:
            row = torch.tensor(data[kind], dtype=torch.float32)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kv_scales_path: {path!r}: bad {kind} ({e})") from e
        if tuple(row.shape) != want:
            raise ValueError(f"kv_scales_path: {path!r}: {kind} has shape {tuple(row.shape)}, "
                             f"the model needs {mc.num_layers} layers x {mc.num_kv_heads} KV "
                             "heads")
        rows.append(row)
    values = torch.stack(rows, dim=1)  # [layers, 2, heads]
    return _checked(values, f"file {path} ({data.get('source', 'no source recorded')})")


def from_checkpoint(found: dict[tuple[int, str], torch.Tensor],
                    mc: ModelConfig) -> KVScales | None:
    """found: (layer, 'k' | 'v') -> the checkpoint's scale (one value, or one per KV head)."""
    if not found:
        return None
    values = torch.empty(mc.num_layers, 2, mc.num_kv_heads)
    for layer in range(mc.num_layers):
        for row, kind in enumerate("kv"):
            t = found.get((layer, kind))
            if t is None:
                raise ValueError(f"checkpoint: layer {layer} has no {kind}_scale while other "
                                 "layers have FP8 KV scales")
            if t.numel() not in (1, mc.num_kv_heads):
                raise ValueError(f"checkpoint: layer {layer} {kind}_scale has {t.numel()} "
                                 f"values (1 or {mc.num_kv_heads} expected)")
            values[layer, row] = t.float().flatten()
    return _checked(values, "checkpoint")


def _checked(values: torch.Tensor, source: str) -> KVScales:
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"FP8 KV scales from {source}: every scale must be finite and > 0")
    return KVScales(values, source)


def calibration_prompts(runner: ModelRunner, tokenizer, path: str | None
                        ) -> tuple[list[list[int]], int, str]:
    """(token ids of each prompt, tokens to sample after each (1: read the prompt only, the
    sampled token's KV is never written), description)."""

    if path is not None:
        if tokenizer is None:
            raise ValueError("calibration_file: the model has no tokenizer")
        try:
            with open(path) as f:
                ids = tokenizer.encode(f.read())
        except OSError as e:
            raise ValueError(f"calibration_file: cannot read {path!r}: {e}") from e
        if len(ids) < 2:
            raise ValueError(f"calibration_file: {path!r} holds no text")
        chunks = [ids[i:i + FILE_CHUNK] for i in range(0, len(ids), FILE_CHUNK)][:FILE_CHUNKS]
        return chunks, 1, f"{sum(map(len, chunks))} tokens of {path}"
    prompts = texts(runner, tokenizer, TEXTS)
    return prompts, 1, f"{len(prompts)} built-in texts"


@torch.inference_mode()
def calibrate(runner: ModelRunner, spec: KVSpec, prompts: list[list[int]], generate: int,
              what: str) -> KVScales:
    """Run prompts (then `generate` greedy tokens each) through the runner's model into a
    zeroed cache of spec in its activation dtype; scales = per-head amax * HEADROOM / 448. The
    runner must have no pool bound yet (a worker calibrates before it sizes its pool) and no
    graphs; it has none afterwards either."""
    mc, page_size = runner.model_config, spec.page_size
    if runner.pool is not None or runner.graphs is not None:
        raise RuntimeError("kv_scales.calibrate: the runner is already bound to a pool")
    requests, num_pages = scratch_requests("calibrate", prompts, page_size, generate)
    pool = spec.unquantized(mc, runner.dtype).pool(num_pages, runner.device)
    runner.bind(pool)
    try:
        todo = [len(ids) for ids in prompts]
        for _ in range(generate):  # (the first step reads the prompts)
            _step(runner, requests, todo)
            todo = [1] * len(requests)
        written = sum(r.num_computed_tokens for r in requests)
        # (MLA: K and V are the latent rows, before any DSA index key, one scale a layer)
        parts = ([pool.k[i][..., :mc.latent_width]] * 2 if mc.mla is not None
                 else [pool.k[i], pool.v[i]] for i in range(mc.num_layers))
        amax = torch.stack([torch.stack([x.abs().amax(dim=(0, 1, 3)) for x in kv])
                            for kv in parts]).float().cpu()
    finally:
        runner.bind(None)
        del pool
        if runner.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the pool sizing that follows counts cached blocks as used
    # a head that saw only zeros could take any scale: give it a tiny one, not 1.0
    source = f"calibrated on {what} ({written} tokens)"
    return _checked(amax.clamp(min=1e-4) * HEADROOM / FP8_MAX, source)


def _step(runner: ModelRunner, requests: list[Request], num_new: list[int]) -> None:
    result = runner.execute(SchedulerOutput(requests, num_new))
    for request, n, token in zip(requests, num_new, result.tokens):
        request.num_computed_tokens += n
        request.output_token_ids.append(token)


def resolve(runner: ModelRunner, spec: KVSpec, found: dict[tuple[int, str], torch.Tensor],
            tokenizer) -> KVScales:
    """The FP8 KV scales to use (see the module docstring for the order)."""
    cache = runner.config.cache
    scales = from_checkpoint(found, runner.model_config)
    if scales is None and cache.kv_scales_path:
        scales = load(cache.kv_scales_path, runner.model_config)
    if scales is None:
        scales = calibrate(runner, spec, *calibration_prompts(runner, tokenizer,
                                                               cache.calibration_file))
        scales.source = "start-up: " + scales.source
    logger.info("FP8 KV scales: %s", scales.describe())
    return scales
