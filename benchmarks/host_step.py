"""Micro-benchmark: the host's share of a decode step with 256 long requests, by their length.

A one-layer model with random weights and the default model's tokenizer, on the CPU. Requests
are placed in the running batch already holding L tokens (prompt + output, their pages handed
out, their text decoded), so no prefill runs; then decode steps run through LLMEngine.step
(overlap on) and each step's outputs are handed to an asyncio loop as the server does
(engine.output_stream.send). Host time = step wall time minus the model's forward, logits,
sampling and integrity check (device work on a GPU), plus the hand-off. It should not grow with
L: nothing per step may cost O(tokens so far).
   python benchmarks/host_step.py [--lengths 1024,2048,4096,8192] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from frugal.config import CacheConfig, EngineConfig, SchedulerConfig
from frugal.core.page_table import PageTable
from frugal.engine import llm_engine
from frugal.engine.detokenizer import IncrementalDetokenizer
from frugal.engine.llm_engine import LLMEngine
from frugal.engine.output_stream import OutputStream, send
from frugal.loader import open_checkpoint
from frugal.request import Request, RequestStatus, SamplingParams
from frugal.worker import model_runner

PROMPT_LEN = 64
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
          "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 16384,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
          "eos_token_id": 2}


class Timers:
    """Seconds spent in wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed


def model_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="frugal-host-step-"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    open_checkpoint(None).tokenizer.save(path)
    return path


def seat(engine: LLMEngine, num_requests: int, length: int, rng: random.Random) -> None:
    """Put requests into the running batch as if `length` tokens were computed already."""
    scheduler, tok = engine.scheduler, engine.tokenizer
    params = SamplingParams(max_tokens=length, ignore_eos=True, temperature=0)
    words = ["the", "engine", "serves", "pages", "of", "tokens", "quickly", "and", "well"]
    text = " ".join(rng.choice(words) for _ in range(2 * length))
    for i in range(num_requests):
        ids = tok.encode(text[i:], add_special_tokens=False)[:length]
        prompt = ids[:PROMPT_LEN]
        request = Request(str(i), None, prompt, params, PROMPT_LEN + 2 * length)
        request.output_token_ids = ids[PROMPT_LEN:]
        request.num_sent = len(request.output_token_ids)
        request.num_computed_tokens = length - 1  # the last token is the next step's input
        request.page_table = PageTable(
            scheduler.kv.allocator.allocate(-(-(length - 1) // scheduler.page_size)))
        request.status = RequestStatus.RUNNING
        detok = IncrementalDetokenizer(tok, True, params.stop)
        detok.update(request.output_token_ids[:-1])  # twice: its window ends at the last token
        detok.update(request.output_token_ids)
        detok.take(final=False)
        engine._requests[request.request_id] = request
        engine._detokenizers[request.request_id] = detok
        scheduler.running.append(request)


def measure(path: Path, num_requests: int, length: int, steps: int) -> dict:
    pages = num_requests * (-(-(length + steps + 16) // 16))
    engine = LLMEngine(EngineConfig(
        model=str(path), load_format="dummy", device="cpu", dtype="bfloat16",
        cache=CacheConfig(kv_cache_memory=pages * 16 * 256),
        scheduler=SchedulerConfig(max_num_seqs=num_requests, max_model_len=16384)))
    runner, timers = engine.runner, Timers()
    for name in ("forward", "compute_logits", "_check"):
        setattr(runner, name, timers.wrap("device", getattr(runner, name)))
    runner.sampler = timers.wrap("device", runner.sampler)
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    model_runner.prepare = timers.wrap("prepare", model_runner.prepare)
    engine._apply = timers.wrap("outputs", engine._apply)
    seat(engine, num_requests, length, random.Random(length))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    streams = {rid: OutputStream(loop, PROMPT_LEN) for rid in engine._requests}
    rows: dict[str, list[float]] = {}
    try:
        for i in range(steps + 2):
            before = dict(timers.seconds)
            start = time.perf_counter()
            outputs = engine.step()
            send([(streams[out.request_id], out) for out in outputs])
            wall = time.perf_counter() - start
            spent = {k: v - before.get(k, 0.0) for k, v in timers.seconds.items()}
            spent["host"] = wall - spent.get("device", 0.0)
            if i >= 2:  # the first steps fill the overlap pipeline
                for k, v in spent.items():
                    rows.setdefault(k, []).append(v)
    finally:
        model_runner.prepare = model_runner.prepare.__wrapped__
        loop.call_soon_threadsafe(loop.stop)
    return {"length": length, "requests": num_requests,
            **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output", default=None, help="write the rows as JSON here")
    a = p.parse_args()
    path = model_dir()
    rows = [measure(path, a.requests, int(n), a.steps) for n in a.lengths.split(",")]
    print(f"{a.requests} requests, median of {a.steps} decode steps, ms per step:")
    print("| tokens per request | host | schedule | prepare inputs | record tokens + outputs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['host_ms']:.2f} | {r['schedule_ms']:.2f} | "
              f"{r['prepare_ms']:.2f} | {r['outputs_ms']:.2f} |")
    print(f"command: python benchmarks/host_step.py --lengths {a.lengths} "
          f"--requests {a.requests} --steps {a.steps}")
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    llm_engine.logger.setLevel("WARNING")
    main()
