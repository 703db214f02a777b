"""Micro-benchmark: one decode step of the whole model (its CUDA graph) under each PDL mode
and each threshold of the decode attention's context split.

Loads a preset with random weights, prefills 64 requests of 512 tokens, then times replays of
the decode graph at each batch size, recapturing the graphs for each FRUGAL_PDL mode (see
frugal.ops.triton.launch) and each --split-below (ops.triton.attention._SPLIT_BELOW: requests
× KV heads below which a decode splits each context; 0: never) in the same process; the
variants alternate over the rounds. Medians of 5 x 50 replays (device time per step); `same
argmax` checks that every variant picks the tokens of the first. A threshold ending in "f"
(264f) also keeps every split at the flat minimum (_MIN_SPLIT) and unsplit decodes on the split
launch's tiles, as the decode attention was before min_split_keys and _UNSPLIT_LAUNCH.
   python benchmarks/decode_step.py [--quantization none|int4|fp8] [--modes wait,trigger]
   python benchmarks/decode_step.py --model qwen3-30b-a3b --modes trigger --split-below 128,264f
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from frugal.bench.offline import prompts_for
from frugal.config import EngineConfig, SchedulerConfig
from frugal.core.scheduler import SchedulerOutput
from frugal.engine.llm_engine import LLMEngine
from frugal.ops.triton import attention
from frugal.request import SamplingParams
from frugal.worker.step_inputs import prepare


def step_ms(runner, inputs) -> float:
    for _ in range(20):
        runner.graphs.run(inputs)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(50):
            runner.graphs.run(inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 50)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", default="none")
    p.add_argument("--modes", default="wait,trigger")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--split-below", default=str(attention._SPLIT_BELOW))
    p.add_argument("--disable-shared-experts-fusion", action="store_true")
    a = p.parse_args()
    sizes = [int(s) for s in a.batch.split(",")]
    engine = LLMEngine(EngineConfig(model=a.model, load_format="dummy",
                                    quantization=a.quantization, cuda_graph_max_bs=max(sizes),
                                    shared_experts_fusion=not a.disable_shared_experts_fusion,
                                    scheduler=SchedulerConfig(max_num_seqs=max(sizes)),
                                    overlap_schedule=False))  # (no token left pending below)
    vocab = engine.runner.model_config.vocab_size
    for prompt in prompts_for(max(sizes), 512, vocab, 0):
        engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine._requests.values()):
        engine.step()  # prefill
    for _ in range(8):
        engine.step()
    runner = engine.runner
    requests = list(engine._requests.values())
    inputs = {n: prepare(SchedulerOutput(requests[:n], [1] * n), runner.pool.page_size,
                         runner.device, check=runner.integrity) for n in sizes}
    print(f"{torch.cuda.get_device_name()} | {a.model}, weights {a.quantization} | decode-step "
          "graph replay medians, ms\n")
    print("| round | PDL mode | split below | batch | ms | same argmax |")
    print("|---|---|---|---|---|---|")
    first: dict[int, torch.Tensor] = {}
    variants = list(itertools.product(a.modes.split(","), a.split_below.split(",")))
    own = attention.min_split_keys, attention._unsplit_fits
    for r in range(a.rounds):
        for mode, below in variants:
            os.environ["FRUGAL_PDL"] = mode
            attention._SPLIT_BELOW = int(below.removesuffix("f"))
            attention.min_split_keys, attention._unsplit_fits = own if not below.endswith(
                "f") else (lambda *_: attention._MIN_SPLIT, lambda *_: False)
            runner._graph_sets.clear()
            runner.graphs = None
            torch.cuda.empty_cache()
            runner.set_integrity(runner.integrity)  # recaptures under this mode
            for n in sizes:
                logits, _ = runner.graphs.run(inputs[n])
                top = logits.argmax(-1)
                same = torch.equal(first.setdefault(n, top), top)
                print(f"| {r} | {mode} | {below} | {n} | {step_ms(runner, inputs[n]):.3f} | "
                      f"{same} |", flush=True)


if __name__ == "__main__":
    main()
