"""`frugal bench serve`: drive a running OpenAI-compatible server, as `vllm bench serve` does.

For each concurrency c, --num-prompts requests of --input-len random token ids each (after one
shared --prefix-len prefix, as `vllm bench serve --random-prefix-len` builds them) stream
--output-len tokens (ignore_eos, greedy) through /v1/completions with at most c in flight. Reports
request throughput, output tok/s, and mean / median / p99 of time to first token (TTFT),
inter-token latency (ITL: the gaps between streamed chunks) and time per output token after the
first (TPOT), and the share of prompt tokens the server's prefix cache held (from its /metrics:
frugal's or vLLM's counters). Works against any server that takes token-id prompts (frugal,
vLLM, SGLang).

A mixed workload: --long-input-len L --long-rate R sends, while each concurrency's requests
run, prompts of L random tokens (one output token each) at R a second, evenly spaced: what
long prompts arriving at a decoding server do to its inter-token latency (the ITL columns are
the measured requests' alone; the long prompts' TTFT is reported beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from frugal.cli.args import command_line


@dataclass
class RequestTrace:
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


@dataclass
class ServeResult:
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    request_s: float
    output_tok_s: float
    ttft_ms: tuple[float, float, float]  # mean, median, p99
    itl_ms: tuple[float, float, float]
    tpot_ms: tuple[float, float, float]
    prefix_hit_rate: float | None = None  # prompt tokens found in the prefix cache / looked up
    long_completed: int = 0  # long prompts (--long-input-len) answered while these ran
    long_failed: int = 0
    long_ttft_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="latency and throughput of a running server")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument("--api-key", default="none")
    s.add_argument("--concurrency", default="1,8", help="comma-separated in-flight limits")
    s.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency")
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--prefix-len", type=int, default=0,
                   help="random tokens shared by every prompt, before its own --input-len")
    s.add_argument("--output-len", type=int, default=64)
    s.add_argument("--token-range", default="1000,10000",
                   help="prompt token ids are drawn from [LO, HI)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--long-input-len", type=int, default=0,
                   help="a mixed workload: prompts of this many tokens (1 output token) sent "
                        "at --long-rate while the measured requests run")
    s.add_argument("--long-rate", type=float, default=0.0, help="long prompts a second")
    s.add_argument("--output", default=None, help="write results as JSON")
    s.set_defaults(func=run_serve)


def _stats(values: list[float]) -> tuple[float, float, float]:
    """mean, median, p99 in ms of values in seconds (zeros when empty)."""
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return (1e3 * statistics.mean(ordered), 1e3 * statistics.median(ordered), 1e3 * p99)


async def _one(client, model: str, prompt: list[int], output_len: int) -> RequestTrace:
    trace = RequestTrace()
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                trace.chunk_times.append(now - start)
            if chunk.usage is not None:
                trace.output_tokens = chunk.usage.completion_tokens
        trace.latency = time.perf_counter() - start
        if not trace.chunk_times:
            raise ValueError("the stream carried no text")
        trace.ttft = trace.chunk_times[0]
    except Exception as e:  # a failed request is counted and reported, not fatal
        trace.error = f"{type(e).__name__}: {e}"
    return trace


async def measure(client, model: str, prompts: list[list[int]], concurrency: int,
                  output_len: int, bar: tqdm, long_prompts: list[list[int]] | None = None,
                  long_rate: float = 0.0) -> ServeResult:
    """prompts at most `concurrency` at a time; long_prompts (cycled), one every 1 / long_rate
    s from the start until the last of prompts has ended, each with one output token."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int]) -> RequestTrace:
        async with gate:
            trace = await _one(client, model, prompt, output_len)
            bar.update(1)
            return trace

    async def arrivals(sent: list[asyncio.Task]) -> None:
        for i in range(1 << 62):
            sent.append(asyncio.create_task(_one(client, model,
                                                 long_prompts[i % len(long_prompts)], 1)))
            await asyncio.sleep(1.0 / long_rate)

    start, sent = time.perf_counter(), []
    feeder = asyncio.create_task(arrivals(sent)) if long_prompts else None
    traces = await asyncio.gather(*(limited(p) for p in prompts))
    duration = time.perf_counter() - start
    if feeder is not None:
        feeder.cancel()
    longs = list(await asyncio.gather(*sent))
    ok = [t for t in traces if t.error is None]
    for t in traces:
        if t.error is not None:
            print(f"request failed: {t.error}", file=sys.stderr)
    itls = [b - a for t in ok for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    tpots = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    return ServeResult(
        concurrency=concurrency, completed=len(ok), failed=len(traces) - len(ok),
        duration_s=duration, request_s=len(ok) / duration,
        output_tok_s=sum(t.output_tokens for t in ok) / duration,
        ttft_ms=_stats([t.ttft for t in ok]), itl_ms=_stats(itls), tpot_ms=_stats(tpots),
        long_completed=sum(t.error is None for t in longs),
        long_failed=sum(t.error is not None for t in longs),
        long_ttft_ms=_stats([t.ttft for t in longs if t.error is None]))


# (queries, hits) counters of prefix caches, as frugal and vLLM name them in /metrics
CACHE_COUNTERS = (("frugal_prefix_cache_queries_total", "frugal_prefix_cache_hits_total"),
                  ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))


def cache_counters(url: str, api_key: str | None = None) -> tuple[float, float] | None:
    """The server's prefix-cache (queries, hits) token counters, None if it reports none."""
    req = urllib.request.Request(url.rstrip("/") + "/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
    except Exception:
        return None
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # (summed over labels: vLLM's engines, models)
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    for queries, hits in CACHE_COUNTERS:
        if queries in totals:
            return totals[queries], totals.get(hits, 0.0)
    return None


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None):
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


async def _first_model(client, url: str) -> str:
    """The id of the first model the server lists; ValueError saying why there is none."""
    from openai import APIConnectionError, APIStatusError

    try:
        models = (await client.models.list()).data
    except APIConnectionError as e:
        raise ValueError(f"url: no OpenAI-compatible server answers at {url} ({e})") from e
    except APIStatusError as e:
        raise ValueError(f"url: {url}/v1/models answered HTTP {e.status_code}: "
                         f"{e.message}") from e
    if not models:
        raise ValueError(f"model: {url} lists no model; pass --model")
    return models[0].id


async def _main(args: argparse.Namespace) -> list[ServeResult]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key,
                         max_retries=0, timeout=3600)
    try:
        model = args.model or await _first_model(client, args.url)
    except ValueError:
        await client.close()
        raise
    lo, hi = (int(x) for x in args.token_range.split(","))
    rng = random.Random(args.seed)
    prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(lo, hi) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    longs = [[rng.randrange(lo, hi) for _ in range(args.long_input_len)] for _ in range(4)
             ] if args.long_input_len else None
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results = []
    await _one(client, model, prompts[0], 4)  # warm-up
    with tqdm(total=len(concurrencies) * len(prompts), file=sys.stderr,
              desc="bench serve") as bar:
        for c in concurrencies:
            before = await asyncio.to_thread(cache_counters, args.url, args.api_key)
            results.append(await measure(client, model, prompts, c, args.output_len, bar,
                                         longs, args.long_rate))
            results[-1].prefix_hit_rate = hit_rate(
                before, await asyncio.to_thread(cache_counters, args.url, args.api_key))
    await client.close()
    return results


def format_table(results: list[ServeResult], args: argparse.Namespace) -> str:
    def trio(v: tuple[float, float, float]) -> str:
        return " | ".join(f"{x:.2f}" for x in v)

    prefix = f"{args.prefix_len} shared + " if args.prefix_len else ""
    lines = [f"server: {args.url} | {args.num_prompts} prompts | {prefix}{args.input_len} in / "
             f"{args.output_len} out", "",
             "| concurrency | completed | failed | req/s | output tok/s | TTFT mean | median "
             "| p99 | ITL mean | median | p99 | TPOT mean | median | p99 | cache hit % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        hits = "-" if r.prefix_hit_rate is None else f"{100 * r.prefix_hit_rate:.1f}"
        lines.append(f"| {r.concurrency} | {r.completed} | {r.failed} | {r.request_s:.2f} "
                     f"| {r.output_tok_s:.1f} | {trio(r.ttft_ms)} | {trio(r.itl_ms)} "
                     f"| {trio(r.tpot_ms)} | {hits} |")
    if args.long_input_len:
        lines += ["", f"long prompts ({args.long_input_len} in / 1 out, {args.long_rate:g} a "
                  "second, beside the requests above):", "",
                  "| concurrency | completed | failed | TTFT mean | median | p99 |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r.concurrency} | {r.long_completed} | {r.long_failed} "
                  f"| {trio(r.long_ttft_ms)} |" for r in results]
    lines += ["", "(latencies in ms)", f"command: {command_line()}"]
    return "\n".join(lines)


def run_serve(args: argparse.Namespace) -> int:
    lo, hi = (int(x) for x in args.token_range.split(","))
    if not 0 <= lo < hi:
        raise ValueError(f"token_range: need 0 <= LO < HI, got {args.token_range!r}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    if args.prefix_len < 0:
        raise ValueError(f"prefix_len: must be >= 0, got {args.prefix_len}")
    if args.long_input_len < 0 or (args.long_input_len > 0) != (args.long_rate > 0):
        raise ValueError("long_input_len / long_rate: both > 0 for a mixed workload, or neither")
    if any(int(c) < 1 for c in args.concurrency.split(",")):
        raise ValueError(f"concurrency: each must be >= 1, got {args.concurrency!r}")
    results = asyncio.run(_main(args))
    print(format_table(results, args))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": command_line(), "results": [asdict(r) for r in results]}, f,
                      indent=2)
    return 0 if all(r.failed == 0 for r in results) else 1
