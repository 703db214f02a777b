"""`frugal bench offline`: throughput and latency of the engine at fixed concurrencies.

Each concurrency c submits c random prompts of --input-len tokens at once, each generating exactly
--output-len tokens (ignore_eos, greedy), and reports prompt and generation throughput, TTFT and
inter-token latency. `--peer hf` measures HF transformers `generate` on the same checkpoint, the
same prompts and the same device in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from frugal.cli.args import add_engine_args, command_line, engine_config
from frugal.engine.llm_engine import LLMEngine
from frugal.request import SamplingParams


@dataclass
class Result:
    system: str
    concurrency: int
    prompt_tok_s: float  # prompt tokens / time until every request has its first token
    gen_tok_s: float  # output tokens after the first / time from then to the end
    output_tok_s: float  # all output tokens / total wall time (prefill included)
    ttft_ms: float  # mean time to first token
    itl_ms: float  # mean inter-token latency
    itl_p99_ms: float


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    o = sub.add_parser("offline", help="offline throughput and latency by concurrency")
    add_engine_args(o)
    o.add_argument("--concurrency", default="1,16", help="comma-separated request counts")
    o.add_argument("--input-len", type=int, default=128)
    o.add_argument("--output-len", type=int, default=128)
    o.add_argument("--peer", choices=["none", "hf"], default="none",
                   help="also measure HF transformers generate in the same run")
    o.add_argument("--repeats", type=int, default=1, help="runs per point; medians reported")
    o.add_argument("--output", default=None, help="write results as JSON")
    o.set_defaults(func=run_offline)


def prompts_for(concurrency: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, away from the special tokens at the start of most vocabularies."""
    gen = torch.Generator().manual_seed(seed + concurrency)
    ids = torch.randint(256, vocab_size, (concurrency, input_len), generator=gen)
    return ids.tolist()


def measure_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> Result:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    times: dict[str, list[float]] = {engine.add_request(p, params): [] for p in prompts}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in times:
                times[out.request_id].append(now)
    end = time.perf_counter()
    first_all = max(t[0] for t in times.values())
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    c, n_in = len(prompts), len(prompts[0])
    return Result(
        system="frugal", concurrency=c,
        prompt_tok_s=c * n_in / (first_all - start),
        gen_tok_s=c * (output_len - 1) / (end - first_all) if output_len > 1 else 0.0,
        output_tok_s=c * output_len / (end - start),
        ttft_ms=1e3 * statistics.mean(t[0] - start for t in times.values()),
        itl_ms=1e3 * statistics.mean(gaps) if gaps else 0.0,
        itl_p99_ms=1e3 * _percentile(gaps, 99) if gaps else 0.0,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_offline(args: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine = LLMEngine(engine_config(args))
    vocab = engine.model_config.vocab_size
    systems = {"frugal": lambda p, n: measure_engine(engine, p, n)}
    if args.peer == "hf":
        from frugal.bench.hf_peer import HFPeer

        peer = HFPeer(args.model, engine.runner.device, engine.runner.dtype)
        systems["transformers"] = peer.measure
    for measure in systems.values():  # warm-up
        measure(prompts_for(1, args.input_len, vocab, args.seed + 1), 8)
    runs: dict[tuple[str, int], list[Result]] = {}
    # repeats interleave the systems, so drift on a shared machine hits both alike
    with tqdm(total=args.repeats * len(systems) * len(concurrencies), file=sys.stderr) as bar:
        for _ in range(args.repeats):
            for name, measure in systems.items():
                for c in concurrencies:
                    prompts = prompts_for(c, args.input_len, vocab, args.seed)
                    runs.setdefault((name, c), []).append(measure(prompts, args.output_len))
                    bar.update(1)
    results = [median_result(r) for r in runs.values()]
    print(format_table(results, engine, args))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": command_line(), "results": [asdict(r) for r in results],
                       "runs": [asdict(r) for rs in runs.values() for r in rs]}, f, indent=2)
    return 0


def median_result(runs: list[Result]) -> Result:
    """Each metric's median over repeated runs of one (system, concurrency)."""
    fields = {k: statistics.median(getattr(r, k) for r in runs)
              for k in ("prompt_tok_s", "gen_tok_s", "output_tok_s", "ttft_ms", "itl_ms",
                        "itl_p99_ms")}
    return Result(system=runs[0].system, concurrency=runs[0].concurrency, **fields)


def _fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f}"


def format_table(results: list[Result], engine: LLMEngine, args: argparse.Namespace) -> str:
    mc, runner = engine.model_config, engine.runner
    lines = [
        f"model: {mc.architecture} {mc.num_layers} layers, hidden {mc.hidden_size} | "
        f"{str(runner.dtype).removeprefix('torch.')} on {runner.device} | "
        f"{args.input_len} in / {args.output_len} out | torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads | median of {args.repeats} run(s)",
        "",
        "| system | concurrency | prompt tok/s | gen tok/s | output tok/s | mean TTFT ms "
        "| mean ITL ms | p99 ITL ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.system} | {r.concurrency} | {r.prompt_tok_s:.0f} | {r.gen_tok_s:.1f} "
                     f"| {r.output_tok_s:.1f} | {r.ttft_ms:.1f} | {r.itl_ms:.1f} "
                     f"| {_fmt(r.itl_p99_ms)} |")
    ours = {r.concurrency: r for r in results if r.system == "frugal"}
    peers = [r for r in results if r.system != "frugal"]
    if peers:
        lines += ["", "| concurrency | prompt tok/s ratio | gen tok/s ratio (frugal / peer) |",
                  "|---|---|---|"]
        for p in peers:
            o = ours[p.concurrency]
            lines.append(f"| {p.concurrency} | {o.prompt_tok_s / p.prompt_tok_s:.2f}x "
                         f"| {o.gen_tok_s / p.gen_tok_s:.2f}x |")
    lines += ["", f"command: {command_line()}"]
    return "\n".join(lines)
