"""Steps through the graph sets' padded static buffers (worker.cuda_graph's decode steps,
worker.prompt_graphs' steps with prompt tokens; run eagerly here: the graphs themselves are
captured on a GPU) give the tokens and log-probabilities of plain steps: prompts alone and
beside decodes, in chunks, after prefix-cache hits, decode batches padded, with the integrity
check on and off; the padding touches no page."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.config import CacheConfig, EngineConfig, SchedulerConfig
from frugal.worker.cuda_graph import DecodeGraphs
from frugal.worker.prompt_graphs import PromptGraphs, request_sizes, token_sizes


def test_buckets_cover_every_step_up_to_the_largest():
    assert token_sizes(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert token_sizes(40) == [16, 32, 40] and token_sizes(16) == [16]
    assert request_sizes(256) == [1, 4, 16, 64, 256] and request_sizes(5) == [1, 4, 5]
    graphs = PromptGraphs.__new__(PromptGraphs)
    graphs.token_sizes, graphs.request_sizes = token_sizes(96), request_sizes(20)
    pairs = set(graphs._pairs())
    for tokens in range(2, 97):  # a step of T tokens over R <= T requests finds its graph
        for requests in range(1, min(tokens, 20) + 1):
            t = min(s for s in graphs.token_sizes if s >= tokens)
            r = min(s for s in graphs.request_sizes if s >= requests)
            assert (t, r) in pairs, (tokens, requests)


def _check_padding(graphs: PromptGraphs, inputs) -> int:
    """The buffers of the bucket a step ran in hold it, then padding no kernel can act on:
    token rows of slot -1 in no request, requests with no tokens (offsets at the step's end)
    and seq_len 0. Returns the step's token count."""
    t, r = inputs.input_ids.shape[0], inputs.num_requests
    tokens = min(s for s in graphs.token_sizes if s >= t)
    requests = min(s for s in graphs.request_sizes if s >= r)
    assert bool((graphs.slots[:t] == inputs.meta.slot_mapping).all())
    assert bool((graphs.slots[t:tokens] == -1).all())
    assert graphs.cu_seqlens[:requests + 1].tolist() == inputs.cu_seqlens + [t] * (requests - r)
    assert graphs.seq_lens[:requests].tolist() == inputs.meta.seq_lens.tolist() + [0] * (
        requests - r)
    return t


def _run(engine, prompts, params) -> tuple[list, list]:
    """Each request's tokens and, for each token, its log-prob and its top entries' (the
    scheduler's bookkeeping checked after every step; every page back at the end)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                [lp.logprob, *(v for _, v in lp.top)] for lp in out.outputs[0].logprobs or [])
        engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


def _engine(check: bool, graphs: bool, kv_cache_dtype: str = "auto"):
    config = EngineConfig(dtype="float32", device="cpu",
                          cache=CacheConfig(page_size=4, kv_cache_memory="64MiB",
                                            kv_integrity=check, kv_cache_dtype=kv_cache_dtype,
                                            kv_cache_check=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24))
    engine = LLM.from_config(config).engine
    runs = []
    if graphs:
        runner = engine.runner
        shape = (512, runner.pool.page_size, runner.model_config.vocab_size, runner.dtype,
                 "cpu", runner.pool.tags if check else None)
        padded = PromptGraphs(runner.model, runner.backend, 48, 8, *shape, capture=False)
        run = padded.run

        def checked(inputs):
            result = run(inputs)
            runs.append(_check_padding(padded, inputs))
            return result
        padded.run = checked
        runner.prompt_graphs = padded
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.backend, 8, *shape,
                                              capture=False)
        decode = graphs.run

        def checked_decode(inputs):
            result = decode(inputs)
            b = inputs.num_requests
            bs = min(s for s in graphs.sizes if s >= b)
            assert bool((graphs.slots[b:bs] == -1).all()) and not graphs.seq_lens[b:bs].any()
            runs.append(-b)
            return result
        graphs.run = checked_decode
    return engine, runs


def test_steps_over_contexts_longer_than_the_graphs_run_eagerly():
    """A step whose longest context passes the graphs' token count (a long prompt's later
    chunk, whose absorbed MLA rows would each read the whole context) does not fit; nor does
    one of more tokens, or one reading prompts through the cache."""
    from types import SimpleNamespace

    engine, _ = _engine(False, True)
    padded = engine.runner.prompt_graphs

    def step(context, tokens=8, fresh=True):
        meta = SimpleNamespace(fresh_kv=fresh, max_seq_len=context,
                               page_table=torch.zeros(1, -(-context // 4), dtype=torch.int32))
        return SimpleNamespace(decode=False, input_ids=torch.zeros(tokens, dtype=torch.int64),
                               num_requests=1, meta=meta)

    assert padded.max_tokens == 48 and padded.fits(step(48))
    assert not padded.fits(step(49))
    assert not padded.fits(step(40, tokens=49)) and not padded.fits(step(40, fresh=False))


PROMPTS = [list(range(100, 121)) + [7, 8], list(range(30, 41)), [5, 6, 7],
           list(range(100, 121)) + [9], list(range(50, 83)), [3, 4], [9, 8, 7, 6], [11]]
MAX_TOKENS = (6, 9, 4, 5, 3, 12, 10, 11)


@pytest.mark.parametrize("check", [True, False])
def test_padded_prompt_steps_equal_plain_ones(check):
    # (the first 21 tokens of prompts 0 and 3: 5 full pages of 4, cached after the first)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in MAX_TOKENS]
    results, counts = [], []
    for graphs in (True, False):
        engine, runs = _engine(check, graphs)
        results.append(_run(engine, PROMPTS, params))
        counts.append(runs)
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)
    # chunks of 24 tokens (padded to 32) and a last one of 16;
    # decode steps (-requests) shrinking as requests end: 7 padded to 8 and 3 to 4, after steps
    # of 8 and 4 filled those rows
    prompt_steps = [n for n in counts[0] if n > 0]
    assert len(prompt_steps) >= 4 and max(prompt_steps) == 24 and min(prompt_steps) < 24
    assert {-8, -7, -4, -3} <= set(counts[0]) and counts[1] == []


def test_padded_prompt_steps_over_a_quantized_cache_read_fresh_kv_as_plain_ones():
    """fp8_v (V e4m3): prompt steps read their own tokens' K/V as computed through the padded
    buffers as in plain steps (the tokens sampled after them: same log-probs; later ones
    within float noise, which rounding to e4m3 amplifies); requests reading their prompts
    through the cache (prompt_from_cache) run their prompt steps eagerly, and the tokens
    sampled after them move."""
    def run(graphs: bool, from_cache: bool):
        """(tokens, log-probs, each request's first log-prob, the padded steps' sizes)"""
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2,
                                 prompt_from_cache=from_cache) for n in MAX_TOKENS]
        engine, runs = _engine(False, graphs, "fp8_v")
        tokens, logprobs = _run(engine, PROMPTS, params)
        return tokens, logprobs, torch.tensor([lp[0][0] for lp in logprobs]), runs

    tokens, logprobs, first, runs = run(True, False)
    assert any(n > 0 for n in runs)
    plain_tokens, plain_logprobs, plain_first, _ = run(False, False)
    assert tokens == plain_tokens
    torch.testing.assert_close(first, plain_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs, plain_logprobs, atol=2e-2, rtol=0)
    _, _, through, runs = run(True, True)
    assert not any(n > 0 for n in runs)  # (decode steps only from the buffers)
    moved = (through - plain_first).abs()  # (the last prompt, one token: nothing to move)
    assert (moved[:-1] > 1e-3).all() and moved[-1] < 1e-5, moved


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_padded_mla_prompt_steps_attend_absorbed_as_plain_steps_expanded(backend, tmp_path):
    """An MLA model's captured prompt steps attend a row a token, absorbed (shapes from host
    bounds only: the MLA decode kernel over each token's own context); plain steps expand their
    prompts. Same tokens, log-probs within fp32 rounding, through the padded buffers, beside
    decodes and after a prefix hit."""
    from frugal.layers.attention import prompt_graph_blocker
    from tests.models.test_mla_vs_hf import write_model

    write_model("deepseek-v3-rope16", str(tmp_path))
    prompts = [list(range(3, 26)), list(range(50, 57)), list(range(3, 22)) + [7]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in (3, 4, 2)]
    results, replays = [], []
    for graphs in (True, False):
        config = EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                              ops_backend=backend,
                              cache=CacheConfig(page_size=4, kv_cache_memory="16MiB"),
                              scheduler=SchedulerConfig(max_num_batched_tokens=16))
        engine = LLM.from_config(config).engine
        runner = engine.runner
        assert prompt_graph_blocker(runner.model_config) is None
        if graphs:
            padded = PromptGraphs(runner.model, runner.backend, 32, 4, 256,
                                  runner.pool.page_size, runner.model_config.vocab_size,
                                  runner.dtype, "cpu", runner.pool.tags, capture=False)
            run = padded.run
            padded.run = lambda inputs, run=run: replays.append(1) or run(inputs)
            runner.prompt_graphs = padded
        results.append(_run(engine, prompts, params))
    assert len(replays) >= 3
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)
