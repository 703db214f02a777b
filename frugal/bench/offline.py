"""`frugal bench offline`: throughput and latency of the engine at fixed concurrencies.

Each concurrency c submits c random prompts of --input-len tokens at once, each generating exactly
--output-len tokens (ignore_eos, greedy), and reports throughput, TTFT, inter-token latency, the
KV pages used and the roofline bound of the workload with the fraction achieved. With --rounds R
a point runs R x c requests in a closed loop, c in flight: a new prompt arrives as a request
finishes, as a load generator with a concurrency limit (`vllm bench serve --max-concurrency`)
drives a server, so prompt chunks share steps with decodes as they do in steady service. `--peer hf`
measures HF transformers `generate` on the same checkpoint (or the same random-weight shape), the
same prompts and the same device in the same run. `--compare-kv-integrity` runs the engine with
the KV-cache integrity check on and off, interleaved, and reports the change.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from frugal.bench.result import OFF, Result, format_table, median_result, plot, run_plot
from frugal.bench.roofline import ModelCost, bound, measure_device
from frugal.bench.serve import add_serve_parser
from frugal.bench.soak import add_soak_parser
from frugal.cli.args import add_engine_args, command_line, engine_config
from frugal.engine.llm_engine import LLMEngine
from frugal.request import SamplingParams


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
    o.add_argument("--rounds", type=int, default=1,
                   help="requests per point = rounds x concurrency, at most concurrency in "
                        "flight (closed loop); 1: one batch submitted at once")
    o.add_argument("--compare-kv-integrity", action="store_true",
                   help="also run with the KV-cache integrity check off (interleaved with on, "
                        "same process) and report the throughput change")
    o.add_argument("--output", default=None, help="write results as JSON")
    o.add_argument("--plot", default=None, help="write a PNG of output tok/s by concurrency")
    o.set_defaults(func=run_offline)
    add_serve_parser(sub)
    add_soak_parser(sub)
    g = sub.add_parser("plot", help="draw the PNG of `bench offline --output` JSONs (several: "
                                    "one line each, named after the file)")
    g.add_argument("results", nargs="+", help="JSON written by bench offline --output")
    g.add_argument("--plot", required=True, help="PNG to write")
    g.set_defaults(func=run_plot)


def prompts_for(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` prompts of random token ids, away from the special tokens at the start of most
    vocabularies."""
    gen = torch.Generator().manual_seed(seed + count)
    ids = torch.randint(256, vocab_size, (count, input_len), generator=gen)
    return ids.tolist()


def measure_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                   concurrency: int | None = None) -> Result:
    """Run every prompt to output_len tokens, at most `concurrency` (default: all) in flight: the
    next prompt is submitted as soon as a request finishes."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    allocator = engine.scheduler.kv.allocator
    c = concurrency or len(prompts)
    queue = iter(prompts)
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for prompt in itertools.islice(queue, c):
        times[engine.add_request(prompt, params)] = [start]
    pages = running = 0
    preemptions = engine.num_preemptions
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        pages = max(pages, allocator.num_pages - allocator.num_free)
        running = max(running, len(engine.scheduler.running))
        for out in outputs:
            if out.request_id in times:
                times[out.request_id].append(now)
            if out.finished:
                for prompt in itertools.islice(queue, 1):
                    times[engine.add_request(prompt, params)] = [now]
    end = time.perf_counter()
    # times[r]: [submitted, token 1, token 2, ...]
    first_all = max(t[1] for t in times.values())
    gaps = [b - a for t in times.values() for a, b in zip(t[1:], t[2:])]
    decode_gaps = [b - a for t in times.values() for a, b in zip(t[1:], t[2:]) if a >= first_all]
    n, n_in = len(prompts), len(prompts[0])
    one_round = n <= c
    return Result(
        system="frugal", concurrency=c,
        prompt_tok_s=n * n_in / (first_all - start),
        gen_tok_s=(n * (output_len - 1) / (end - first_all)
                   if output_len > 1 and one_round else float("nan")),
        output_tok_s=n * output_len / (end - start),
        ttft_ms=1e3 * statistics.mean(t[1] - t[0] for t in times.values()),
        itl_ms=1e3 * statistics.mean(gaps) if gaps else 0.0,
        itl_p99_ms=1e3 * _percentile(gaps, 99) if gaps else 0.0,
        decode_itl_ms=1e3 * statistics.mean(decode_gaps) if decode_gaps else float("nan"),
        kv_pages=pages, max_running=running, preempted=engine.num_preemptions - preemptions,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_offline(args: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    engine = LLMEngine(engine_config(args))
    vocab = engine.model_config.vocab_size
    runner = engine.runner
    device = measure_device(runner.device, runner.dtype)
    cost = ModelCost.of(engine)
    systems = {"frugal": lambda p, n, c=None: measure_engine(engine, p, n, c)}
    if args.compare_kv_integrity:
        def checked(on: bool):
            def measure(p, n, c=None):
                engine.set_integrity(on)
                return measure_engine(engine, p, n, c)
            return measure

        systems = {"frugal": checked(True), OFF: checked(False)}
    if args.peer == "hf":
        if args.rounds != 1:
            raise SystemExit("bench offline: --peer hf runs one static batch per point; "
                             "use --rounds 1")
        from frugal.bench.hf_peer import HFPeer

        peer = HFPeer(args.model, args.load_format, runner.device, runner.dtype)
        systems["transformers"] = peer.measure
    # warm-up: a few full-length prompts, so the batches that mix prompt chunks with decodes
    # (and the kernels compiled for their shapes) are not first met inside a timed point
    warm = prompts_for(min(4, max(concurrencies)), args.input_len, vocab, args.seed + 1)
    for measure in systems.values():
        measure(warm, 8)
    runs: dict[tuple[str, int], list[Result]] = {}
    # the systems alternate at each point, in an order that flips every repeat (A B, B A, ...):
    # drift on a shared machine hits them alike
    with tqdm(total=args.repeats * len(systems) * len(concurrencies), file=sys.stderr,
              desc="bench offline") as bar:
        for repeat in range(args.repeats):
            for c in concurrencies:
                prompts = prompts_for(c * args.rounds, args.input_len, vocab, args.seed)
                order = list(systems.items())
                for name, measure in order[::-1] if repeat % 2 else order:
                    bar.set_postfix_str(f"{name} c={c}")
                    result = measure(prompts, args.output_len, c)
                    result.system = name
                    runs.setdefault((name, c), []).append(result)
                    bar.update(1)
    results = [median_result(runs[(name, c)]) for name in systems for c in concurrencies]
    for r in results:
        b = bound(cost, device, r.concurrency, args.input_len, args.output_len, args.rounds)
        r.bound_tok_s, r.bound_itl_ms = b.output_tok_s, b.decode_step_ms
    print(format_table(results, engine, device, args))
    if args.output:
        with open(args.output, "w") as f:
            workload = {"model": args.model, "input_len": args.input_len,
                        "output_len": args.output_len, "rounds": args.rounds,
                        "kv_cache_dtype": runner.pool.describe()["kv_cache_dtype"]}
            json.dump({"command": command_line(), "workload": workload, "device": asdict(device),
                       "cost": asdict(cost),
                       "results": [asdict(r) for r in results],
                       "runs": [asdict(r) for rs in runs.values() for r in rs]}, f, indent=2)
    if args.plot:
        plot(results, args)
    return 0
