"""Where the time of a `frugal bench offline` point goes: GPU kernel time by kind, and wall time
of the steps that carry prompt tokens against the decode-only ones.

Runs c prompts of --input-len tokens at once to --output-len tokens each (as `bench offline`
does) three times, other prompts each time (none a prefix-cache hit): to compile every kernel
the run needs, under torch.profiler, and timing each step on the host without it. Kernels are
grouped by name into matmuls (cuBLAS/CUTLASS and ours), attention (prompt, decode, merge), the
MoE experts and their routing, layout and combine, the rest by name (--by-name: every kernel by
its name), each with its launches and µs a launch; "GPU idle" is the profiled run's wall time
not covered by any kernel. With PDL (the default on Hopper) a kernel launched early counts its
wait for the one before it: run with FRUGAL_PDL=0 to attribute time to kernels. --host-profile N
then runs one more prompt's step under cProfile and prints the N Python functions that took the
most host time.
   python benchmarks/run_profile.py llama-3.1-8b --load-format dummy --kv-cache-memory 20GiB \
       --kv-cache-dtype fp8 --input-len 4096 --output-len 512 --concurrency 64
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from frugal.bench.offline import measure_engine, prompts_for
from frugal.cli.args import add_engine_args, command_line, engine_config
from frugal.engine.llm_engine import LLMEngine
from frugal.ops.triton import launch
from frugal.request import SamplingParams

# frugal's kernels by their exact names, then vendors' by substrings (first match wins)
NAMED = {"extend_kernel": "attention: prompt",
         **dict.fromkeys(("_decode_kernel", "_mla_decode", "_fp8_decode"), "attention: decode"),
         **dict.fromkeys(("merge_kernel", "_merge"), "attention: merge"),
         **dict.fromkeys(("_gemv", "_sorted_gemm", "_moe_int4_wgmma"), "MoE experts"),
         **dict.fromkeys(("_logits", "_route", "_norm_route", "_count", "_layout", "_place",
                          "_align", "_combine"), "MoE routing, layout, combine"),
         **dict.fromkeys(("_gemv_kernel", "_small_m_kernel", "_fp8_kernel", "_int4_wgmma",
                          "_w8a8"), "matmul")}
KINDS = [("matmul", ("gemm", "nvjet", "xmma", "cutlass"))]


def kind_of(name: str, by_name: bool = False) -> str:
    if by_name:
        return name[:80]
    if name in NAMED:
        return NAMED[name]
    for kind, parts in KINDS:
        if any(p in name for p in parts):
            return kind
    return name[:60]


def timed_steps(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                host: dict | None = None) -> tuple[dict, float]:
    """Wall seconds and counts of steps, split by whether some request was still in its prompt;
    and the seconds from the start until the last such step ended. host: also add up, by step
    kind, the seconds spent in the engine's parts (scheduling, launching, waiting for the
    device and reading results, recording outputs)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    spent: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    kind = ""
    timed = []
    if host is not None:
        def timer(f, name):
            def wrapped(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return f(*args, **kwargs)
                finally:
                    host[(kind, name)] = host.get((kind, name), 0.0) + time.perf_counter() - t
            return wrapped

        for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "launch"),
                            (engine.runner, "finish"), (engine, "_apply")):
            setattr(owner, name, timer(getattr(owner, name), name))
            timed.append((owner, name))
    begin = time.perf_counter()
    prompts_end = 0.0
    while engine.has_unfinished_requests():
        # the kind of the step this call reads: the one launched ahead, or the next scheduled
        ahead = engine._inflight
        prompt = (max(ahead.out.num_new_tokens) > 1 if ahead is not None else
                  bool(engine.scheduler.waiting) or any(
                      r.num_computed_tokens < r.num_prompt_tokens
                      for r in engine.scheduler.running))
        kind = "prompt steps" if prompt else "decode steps"
        start = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        spent[kind] += now - start
        count[kind] += 1
        if prompt:
            prompts_end = now - begin
    for owner, name in timed:
        delattr(owner, name)
    return {k: (spent[k], count[k]) for k in spent}, prompts_end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_engine_args(p)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--top", type=int, default=12, help="rows of the kernel table")
    p.add_argument("--by-name", action="store_true",
                   help="a row per kernel name, not per kind")
    p.add_argument("--host-profile", type=int, default=0, metavar="ROWS",
                   help="also run one prompt step under cProfile and print the Python "
                        "functions that took the most host time (this many rows)")
    a = p.parse_args()
    engine = LLMEngine(engine_config(a))
    vocab = engine.model_config.vocab_size
    # other prompts each pass: none of them in the prefix cache, each pass's prompt steps whole
    prompts = [prompts_for(a.concurrency, a.input_len, vocab, a.seed + 1000 * i)
               for i in range(3)]
    measure_engine(engine, prompts[0], a.output_len)  # compiles every kernel the run needs
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        _, prompts_end = timed_steps(engine, prompts[1], a.output_len)
        torch.cuda.synchronize()
        profiled = time.perf_counter() - start
    host: dict = {}
    start = time.perf_counter()
    steps, _ = timed_steps(engine, prompts[2], a.output_len, host)
    wall = time.perf_counter() - start
    by_kind: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = kind_of(e.name, a.by_name)
            by_kind[kind] += e.time_range.elapsed_us() / 1e6
            calls[kind] += 1
            spans.append((e.time_range.start / 1e6, e.time_range.end / 1e6))
    # device time not covered by kernels, before and after the last prompt step ended (the
    # profiler's clock starts with the first kernel, a little after `start`)
    spans.sort()
    split = spans[0][0] + prompts_end
    idle = {"prompt steps": 0.0, "decode steps": 0.0}
    reach = spans[0][0]
    for lo, hi in spans + [(spans[0][0] + profiled, spans[0][0] + profiled)]:
        if lo > reach:
            idle["prompt steps"] += max(0.0, min(lo, split) - reach)
            idle["decode steps"] += max(0.0, lo - max(reach, split))
        reach = max(reach, hi)
    busy = sum(by_kind.values())
    print(f"`{command_line()}`\n")
    print(f"{torch.cuda.get_device_name()} | {engine.runner.pool.describe()['kv_cache_dtype']} KV"
          f" | PDL {launch.mode_name()} | c={a.concurrency} {a.input_len} in / {a.output_len} out"
          f" | wall {wall:.2f} s "
          f"(profiled: {profiled:.2f} s, kernels {busy:.2f} s)\n")
    parts = ["schedule", "launch", "finish", "_apply"]
    print("| steps | count | wall s | ms per step | device idle s (profiled) | host ms per step: "
          + " / ".join(parts) + " |\n|---|---|---|---|---|---|")
    for k, (s, n) in sorted(steps.items()):
        per = " / ".join(f"{1e3 * host.get((k, part), 0.0) / n:.2f}" for part in parts)
        print(f"| {k} | {n} | {s:.2f} | {1e3 * s / n:.2f} | {idle[k]:.2f} | {per} |")
    print("\n| kernels | s | share of kernel time | launches | µs a launch |\n"
          "|---|---|---|---|---|")
    for k, s in sorted(by_kind.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {k} | {s:.3f} | {100 * s / busy:.1f} % | {calls[k]} | "
              f"{1e6 * s / calls[k]:.1f} |")
    if a.host_profile:
        host_profile(engine, prompts_for(1, a.input_len, vocab, a.seed + 1)[0], a.host_profile)


def host_profile(engine: LLMEngine, prompt: list[int], rows: int) -> None:
    """One request's prompt step under cProfile: where the host's time goes while it launches
    the step (the device is waited for only where the step itself waits)."""
    import cProfile
    import io
    import pstats

    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    engine.step()
    profiler.disable()
    took = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(rows)
    print(f"\none prompt step of {len(prompt)} tokens under cProfile: {1e3 * took:.1f} ms\n")
    print(out.getvalue())


if __name__ == "__main__":
    main()
