"""KV-cache integrity: each fault class (tests/kv_faults.py) fails its victim alone, with a clear
error; every other request's greedy output is byte-identical to a run without the fault; the
pool is whole again afterwards and the engine keeps serving. With the check off, the same fault
silently changes the victim's output (so the test would notice if the check did nothing)."""

import re

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.request import join
from tests import kv_faults as faults

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.", "List three uses of a paperclip.",
           "Once upon a time, in a small village by the mountains,"]
LATE = "A recipe for pancakes: first, mix flour, milk and two eggs, then"  # > 16 tokens
MESSAGE = re.compile(r"KV cache integrity check failed: page \d+ expected tag \d+, found \d+")
INJECT_AT = 3  # after the prefill and two decode steps


def steal_first_page(engine, requests):
    faults.reuse_while_held(engine.scheduler.kv.allocator, requests["0"].page_table[0])


def redirect_first_page(engine, requests):
    faults.redirect(requests["0"].page_table, 0, requests["1"].page_table[0])


def free_twice(engine, requests):
    allocator = engine.scheduler.kv.allocator
    faults.double_free(allocator, allocator._free[0])


FAULTS = {"reuse_while_held": steal_first_page, "redirect": redirect_first_page,
          "double_free": free_twice}


def run(engine, fault=None):
    """PROMPTS from the start, LATE joining at step INJECT_AT (right after the fault, so its
    prefill takes the pages the fault left at the head of the free list). Returns
    {request id: (token ids, finish reason, error, each token's lead over the runner-up)}."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, request_id=str(i))
    joined, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == INJECT_AT:
            if fault is not None:
                fault(engine, engine._requests)
            engine.add_request(LATE, params, request_id="late")
        for out in engine.step():
            join(joined, out)
        steps += 1
    return {rid: (c.token_ids, c.finish_reason, c.error,
                  [lp.top[0][1] - lp.top[1][1] for lp in c.logprobs or []])
            for rid, c in ((rid, out.outputs[0]) for rid, out in joined.items())}


def same_up_to_a_tie(tokens: list[int], want: tuple) -> bool:
    """tokens equal want's, or equal up to a position where want's top two were within 1e-3
    (a batch of another size rounds the fp32 matmuls otherwise: a tie may go either way)."""
    first = next((i for i, (a, b) in enumerate(zip(tokens, want[0])) if a != b), None)
    if first is None:
        return len(tokens) == len(want[0])
    return want[3][first] < 1e-3


ENGINES = ["cpu", "cpu-fp8", pytest.param("cuda", marks=pytest.mark.gpu),
           pytest.param("cuda-fp8", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, llm, fp8_llm):
    if request.param == "cpu":
        return llm.engine
    if request.param == "cpu-fp8":
        return fp8_llm.engine
    return LLM(dtype="float32", device="cuda", kv_cache_memory="512MiB",
               kv_cache_dtype="fp8" if request.param == "cuda-fp8" else "auto").engine


@pytest.fixture(scope="module")
def baseline(engine):
    return run(engine)


@pytest.mark.parametrize("kind", list(FAULTS))
def test_fault_fails_only_its_victim(engine, baseline, kind):
    allocator = engine.scheduler.kv.allocator
    assert engine.overlap  # (on the GPU the next step runs while the fault is found)
    failures = engine.num_integrity_failures
    got = run(engine, FAULTS[kind])
    failed = [rid for rid, (_, reason, *_) in got.items() if reason == "error"]
    assert len(failed) == 1, got
    victim = failed[0]
    assert MESSAGE.fullmatch(got[victim][2])
    assert engine.num_integrity_failures == failures + 1
    for rid, (tokens, reason, *_) in got.items():
        if rid != victim:  # (the victim's going shrinks the batch of the steps after it)
            assert reason == baseline[rid][1] and same_up_to_a_tie(tokens, baseline[rid]), rid
    # nothing leaked, nothing freed twice (the prefix cache may keep pages nobody else holds)
    assert engine.scheduler.kv.num_free == allocator.num_pages
    engine.scheduler.check_integrity()
    again = run(engine)  # the engine keeps serving, with the same results as before
    assert {k: v[:2] for k, v in again.items()} == {k: v[:2] for k, v in baseline.items()}

    # Without the check (and without the host allocator's own checks at free time, as in the
    # engines that have neither) the fault goes unnoticed.
    engine.set_integrity(False)
    allocator._check_live = lambda ref, what: None
    try:
        unchecked = run(engine, FAULTS[kind])
    finally:
        del allocator._check_live
        engine.set_integrity(True)
        allocator.rebuild([])  # the unchecked fault left the books corrupt
    assert all(reason != "error" for _, reason, *_ in unchecked.values())
    assert unchecked[victim][0] != baseline[victim][0]  # silent corruption without the check


def test_check_off_costs_nothing_and_changes_nothing(engine, baseline):
    engine.set_integrity(False)
    try:
        got = run(engine)
    finally:
        engine.set_integrity(True)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in baseline.items()}
    assert engine.runner.pool.tags.dtype == torch.int32


def test_a_step_that_fails_to_launch_loses_no_tag_updates(monkeypatch):
    """The tags of pages handed out for a step whose launch raised (here in prepare) still
    reach the device's tag table with the next step: the request then runs to the same output
    instead of failing the integrity check on its own pages."""
    from frugal.worker import model_runner

    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="32MiB")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    real = model_runner.prepare

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(model_runner, "prepare", real)
        raise RuntimeError("injected")

    monkeypatch.setattr(model_runner, "prepare", fail_once)
    engine = llm.engine
    engine.add_request(PROMPTS[0], params, request_id="a")
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    joined = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            join(joined, out)
    got = joined["a"].outputs[0]
    assert got.error is None and got.token_ids == want.token_ids
    assert engine.runner.pool.tags.tolist() == engine.scheduler.kv.tags()
