"""Prompt and output log-probabilities from the engine's serving path (CPU, fp32)."""

import math

import torch

from frugal import LLM, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog because it wanted to see the river."


def test_prompt_logprobs_match_transformers(llm, hf):
    _, model = hf
    ids = llm.get_tokenizer().encode(TEXT)
    out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert entry.token_id == ids[p]
        assert math.isclose(entry.logprob, ref[p - 1, ids[p]].item(), abs_tol=2e-4)
        assert [t for t, _ in entry.top] == ref[p - 1].topk(3).indices.tolist()


def test_prompt_logprobs_survive_chunking_and_preemption(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=0)
    reference = llm.generate(ids, params)[0].prompt_logprobs
    # 5-token chunks, and a pool of 4 pages so the two requests keep preempting each other
    small = LLM(dtype="float32", device="cpu", max_num_batched_tokens=5,
                kv_cache_memory=4 * 16 * 30 * 2 * 3 * 64 * 4)
    outs = small.generate([ids, ids[:-3]], params)
    assert small.engine.num_preemptions > 0
    for a, b in zip(outs[0].prompt_logprobs[1:], reference[1:]):
        # fp32: chunks of 5 rows take other matmul blockings than one 17-row prefill
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
    assert len(outs[1].prompt_logprobs) == len(ids) - 3


def test_output_logprobs_equal_rescoring_the_output(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2,
                                           ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    assert [e.token_id for e in out.logprobs] == out.token_ids
    rescored = llm.generate(ids + out.token_ids, SamplingParams(max_tokens=1,
                                                                prompt_logprobs=0))[0]
    for mine, again in zip(out.logprobs, rescored.prompt_logprobs[len(ids):]):
        assert mine.token_id == again.token_id
        assert math.isclose(mine.logprob, again.logprob, abs_tol=1e-4)
        assert len(mine.top) == 2 and mine.top[0][1] >= mine.logprob - 1e-6


def test_min_tokens_keeps_generating_past_eos(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64,
                                           min_tokens=20))[0].outputs[0]
    assert len(longer.token_ids) >= 20 and 2 not in longer.token_ids[:19]
