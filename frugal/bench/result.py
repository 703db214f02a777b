"""What a `frugal bench offline` point yields, and how results are shown: the table printed, the
PNG drawn (also from saved JSONs: `frugal bench plot`).

A Result is one (system, concurrency) point of one run, or the median of repeated runs
(median_result). The engine's own rows are named "frugal" (OFF: with the KV-cache integrity check
off); any other system is a peer measured in the same run, compared with the "frugal" row of its
concurrency.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import dataclass

import torch

from frugal.bench.roofline import Device
from frugal.cli.args import command_line
from frugal.engine.llm_engine import LLMEngine


@dataclass
class Result:
    """One (system, concurrency) point: what was measured, and the roofline (NaN until set)."""

    system: str
    concurrency: int
    prompt_tok_s: float  # prompt tokens / time until every request has its first token
    gen_tok_s: float  # output tokens after the first / time from then to the end (one round)
    output_tok_s: float  # all output tokens / total wall time (prefill included)
    ttft_ms: float  # mean time to first token
    itl_ms: float  # mean inter-token latency
    itl_p99_ms: float
    decode_itl_ms: float  # mean inter-token latency once every request has its first token
    kv_pages: int = 0  # most KV pages in use at once
    max_running: int = 0  # most requests running at once (fewer than asked: the KV cache is full)
    preempted: int = 0  # preemptions for KV space during the run
    bound_tok_s: float = float("nan")  # roofline of output_tok_s
    bound_itl_ms: float = float("nan")  # roofline of decode_itl_ms


_METRICS = ("prompt_tok_s", "gen_tok_s", "output_tok_s", "ttft_ms", "itl_ms", "itl_p99_ms",
            "decode_itl_ms")


OFF = "frugal, kv-integrity off"


def median_result(runs: list[Result]) -> Result:
    """Each metric's median over repeated runs of one (system, concurrency)."""
    fields = {k: statistics.median(getattr(r, k) for r in runs) for k in _METRICS}
    return Result(system=runs[0].system, concurrency=runs[0].concurrency,
                  kv_pages=max(r.kv_pages for r in runs),
                  max_running=min(r.max_running for r in runs),
                  preempted=max(r.preempted for r in runs), **fields)


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def format_table(results: list[Result], engine: LLMEngine, device: Device,
                 args: argparse.Namespace) -> str:
    mc, runner = engine.model_config, engine.runner
    name = "gpu " + torch.cuda.get_device_name() if runner.device.startswith("cuda") else "cpu"
    lines = [
        f"model: {mc.architecture} {mc.num_layers} layers, hidden {mc.hidden_size} | "
        f"{str(runner.dtype).removeprefix('torch.')} on {name} | weights: "
        f"{engine.worker.weights_quantization} | {args.input_len} in / {args.output_len} out | "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads | median of {args.repeats} run(s)",
        f"measured: copy bandwidth {device.bandwidth / 1e12:.2f} TB/s, matmul "
        f"{device.matmul_flops / 1e12:.1f} TFLOP/s | KV pool {runner.pool.num_pages} pages of "
        f"{runner.pool.page_size} tokens, {runner.pool.describe()['kv_cache_dtype']} "
        f"({runner.pool.capacity_tokens} tokens) | CUDA graphs: "
        f"{'on' if runner.graphs else 'off'}",
        "",
        "| system | concurrency | output tok/s | bound tok/s | of bound | prompt tok/s "
        "| mean TTFT ms | mean ITL ms | p99 ITL ms | decode ITL ms | bound ITL ms | KV pages "
        "| max running | preempted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mine = r.system.startswith("frugal")
        lines.append(
            f"| {r.system} | {r.concurrency} | {r.output_tok_s:.1f} | {_fmt(r.bound_tok_s)} "
            f"| {r.output_tok_s / r.bound_tok_s:.0%} | {r.prompt_tok_s:.0f} | {r.ttft_ms:.1f} "
            f"| {r.itl_ms:.2f} | {_fmt(r.itl_p99_ms, 2)} | {r.decode_itl_ms:.2f} "
            f"| {_fmt(r.bound_itl_ms, 2)} | {r.kv_pages if mine else 'n/a'} "
            f"| {r.max_running if mine else 'n/a'} | {r.preempted if mine else 'n/a'} |")
    ours = {r.concurrency: r for r in results if r.system == "frugal"}
    peers = [r for r in results if not r.system.startswith("frugal")]
    off = [r for r in results if r.system == OFF]
    if off:
        lines += ["", "| concurrency | output tok/s, check on | check off | change | "
                      "decode ITL ms, on | off | change |", "|---|---|---|---|---|---|---|"]
        for r in off:
            o = ours[r.concurrency]
            lines.append(f"| {r.concurrency} | {o.output_tok_s:.1f} | {r.output_tok_s:.1f} | "
                         f"{o.output_tok_s / r.output_tok_s - 1:+.2%} | {o.decode_itl_ms:.3f} | "
                         f"{r.decode_itl_ms:.3f} | {o.decode_itl_ms / r.decode_itl_ms - 1:+.2%} |")
    if peers:
        lines += ["", "| concurrency | output tok/s ratio (frugal / peer) | prompt tok/s ratio |",
                  "|---|---|---|"]
        for p in peers:
            o = ours[p.concurrency]
            lines.append(f"| {p.concurrency} | {o.output_tok_s / p.output_tok_s:.2f}x "
                         f"| {o.prompt_tok_s / p.prompt_tok_s:.2f}x |")
    lines += ["", f"command: {command_line()}"]
    return "\n".join(lines)


def run_plot(args: argparse.Namespace) -> int:
    results: list[Result] = []
    for path in args.results:
        with open(path) as f:
            saved = json.load(f)
        workload = argparse.Namespace(**saved["workload"], plot=args.plot)
        for r in saved["results"]:
            r = Result(**r)
            if len(args.results) > 1:  # one line per file
                r.system = f"{r.system} ({os.path.splitext(os.path.basename(path))[0]})"
            results.append(r)
    plot(results, workload)
    return 0


def plot(results: list[Result], args: argparse.Namespace) -> None:
    """Output tok/s by concurrency for each system, with its roofline (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r.system for r in results):
        rows = [r for r in results if r.system == system]
        line, = ax.plot([r.concurrency for r in rows], [r.output_tok_s for r in rows], "o-",
                        label=system)
        if system.startswith("frugal") and not system.startswith(OFF):
            ax.plot([r.concurrency for r in rows], [r.bound_tok_s for r in rows], "--",
                    color=line.get_color(), label=f"roofline of {system}")
    ax.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", yscale="log",
           title=f"{args.model or 'default model'}: {args.input_len} in / {args.output_len} out")
    concurrencies = sorted({r.concurrency for r in results})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)
