"""`frugal calibrate-kv`: FP8 KV-cache scales from amax statistics, written for --kv-scales-path."""

from __future__ import annotations

import argparse
import dataclasses

from frugal.cli.args import add_engine_args, engine_config
from frugal.engine.llm_engine import LLMEngine
from frugal.worker import kv_scales


def add_calibrate_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate-kv", help="FP8 KV-cache scales for --kv-scales-path")
    add_engine_args(p)
    p.add_argument("--output", required=True, help="where to write the scales (JSON)")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """Run the model in its activation dtype over --calibration-file (or text it writes from
    built-in prompts) and write each layer's per-head K and V scales (amax / 448)."""
    config = engine_config(args)
    # the statistics come from an unquantized cache; the engine's own pool can stay small
    cache = dataclasses.replace(config.cache, kv_cache_dtype="auto", kv_scales_path=None,
                                calibration_file=None, kv_cache_memory="256MiB")
    engine = LLMEngine(dataclasses.replace(config, cache=cache, enforce_eager=True))
    worker = engine.worker
    prompts = kv_scales.calibration_prompts(worker.runner, engine.tokenizer,
                                            args.calibration_file)
    worker.runner.bind(None)  # (calibrated on a cache of its own)
    scales = kv_scales.calibrate(worker.runner, worker.kv_spec, *prompts)
    scales.save(args.output, config.model or "default")
    print(f"wrote {args.output}: {scales.describe()}")
    return 0
