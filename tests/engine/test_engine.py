"""The engine on the real default model: batch invariance, preemption, chunking, aborts,
stopping, seeds and bad input (CPU, fp32). Integrity is walked after every step."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.engine.llm_engine import LLMEngine
from frugal.request import join
from frugal.worker.kv_pool import KVPool
from frugal.worker.memory import warm_up, warm_up_steps

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def add(a, b):",
    "1, 2, 3, 4,",
    "The mitochondria is the powerhouse of the cell. In this essay we will discuss how cells "
    "produce energy and why it matters for every living thing on Earth, from bacteria",
    "Q: What is 7 times 8?\nA:",
    "Water boils at",
    "My favourite book is",
]


def drive(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Run to completion, checking the bookkeeping after every step."""
    ids = [engine.add_request(p, params) for p in prompts]
    joined = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            join(joined, out)
        engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages, "pages leaked"
    assert all(joined[i].finished for i in ids)
    return [joined[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt alone in a roomy pool."""
    return [drive(llm.engine, [p], GREEDY)[0] for p in PROMPTS]


def test_batch_invariance(llm, reference):
    assert drive(llm.engine, PROMPTS, GREEDY) == reference


def test_tiny_pool_preempts_and_still_matches(reference):
    # 12 pages x 16 tokens = 192 slots: 8 requests of ~10-35 + 24 tokens cannot all fit at once.
    page_bytes = KVPool.page_bytes(30, 16, 3, 64, torch.float32)
    engine = LLM(dtype="float32", device="cpu", kv_cache_memory=12 * page_bytes).engine
    assert engine.runner.pool.num_pages == 12
    assert drive(engine, PROMPTS, GREEDY) == reference
    assert engine.num_preemptions > 0


def test_chunked_prefill_matches(reference):
    chunked = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB",
                  max_num_batched_tokens=7, max_num_seqs=3)
    assert drive(chunked.engine, PROMPTS, GREEDY) == reference


def test_abort_frees_pages_and_others_continue(llm, reference):
    engine = llm.engine
    keep = engine.add_request(PROMPTS[1], GREEDY)
    victim = engine.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=200))
    done = {}
    for _ in range(3):
        for o in engine.step():
            join(done, o)
    held = engine.stats().num_pages_used
    out = engine.abort_request(victim)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.stats().num_pages_used < held
    engine.scheduler.check_integrity()
    while engine.has_unfinished_requests():
        for o in engine.step():
            join(done, o)
    assert done[keep].outputs[0].token_ids == reference[1]
    assert engine.abort_request(victim) is None  # already gone
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages


@pytest.mark.parametrize("prompt, params, field", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([1, 2, 10**6], SamplingParams(), "prompt"),
    ("word " * 9000, SamplingParams(), "prompt"),
])
def test_bad_prompt_rejected_without_disturbing_others(llm, reference, prompt, params, field):
    engine = llm.engine
    keep = engine.add_request(PROMPTS[0], GREEDY)
    done = {}
    for o in engine.step():
        join(done, o)
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            join(done, o)
    assert done[keep].outputs[0].token_ids == reference[0]


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_stop_token_ids_rejected_at_add(llm):
    for bad in ([10**6], [-1], ["x"]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            llm.engine.add_request("hi", SamplingParams(min_tokens=1, stop_token_ids=bad))
    assert not llm.engine.has_unfinished_requests()


def test_generate_releases_requests_when_a_step_fails(llm, monkeypatch):
    engine = llm.engine
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return original()

    original = engine.step
    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(PROMPTS[:3], GREEDY)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free == engine.runner.pool.num_pages


def test_generate_validates_every_prompt_first(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_finish_reasons(llm):
    eos = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == 2 and eos.stop_reason is None
    assert "<|im_end|>" not in eos.text
    length = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 5
    stop_id = length.token_ids[2]
    by_id = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                    stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == length.token_ids[:by_id.token_ids.index(stop_id) + 1]


def test_stop_string_spanning_tokens_is_cut(llm):
    full = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string made of the end of token 4 and the start of token 5
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  stop=[stop, "never-appears"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    assert stop not in cut.text


def test_streamed_text_never_shows_part_of_a_stop_string(llm):
    full = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].text
    stop = full[20:26]
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    seen, text = [], ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                text += o.outputs[0].text
                seen.append(text)
    assert all(full.startswith(t) and len(t) <= 20 for t in seen)
    assert seen[-1] == full[:20]


def test_seeds(llm):
    def sample(seed, prompts=PROMPTS[:1]):
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    a = sample(1234)
    assert sample(1234) == a
    assert sample(4321) != a
    # a seeded request gives the same tokens inside a batch of others
    assert sample(1234, PROMPTS[:1] * 4) == a * 4


def test_chat_accepts_one_or_many_conversations(llm):
    conv = [{"role": "user", "content": "Say hi."}]
    one = llm.chat(conv, SamplingParams(temperature=0, max_tokens=8))
    many = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=8))
    assert len(one) == 1 and len(many) == 2
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids


def test_warm_up_steps_write_nothing_to_the_cache():
    """The start-up dummy prompt steps (run on GPUs, to compile kernels before the first
    request; the powers of two up to the step budget and the budget's among them) leave every
    KV page as it was."""
    llm = LLM(device="cpu", dtype="float32", kv_cache_memory="8MiB")
    pool = llm.engine.runner.pool
    for cache in list(pool.k) + list(pool.v):  # (fresh CPU pages are uninitialized: NaN ≠ NaN)
        cache.normal_()
    before = [k.clone() for k in pool.k] + [v.clone() for v in pool.v]
    assert warm_up_steps(300)[-3:] == ((0, 128), (0, 256), (0, 300))
    warm_up(llm.engine.runner, budget=300)
    assert all(torch.equal(a, b) for a, b in zip(before, list(pool.k) + list(pool.v)))


def test_step_budget_follows_the_device_unless_given(monkeypatch):
    """As vLLM's server: 8192 tokens a step on a GPU of 70 GiB or more, 2048 elsewhere; a
    given budget stands."""
    from types import SimpleNamespace

    from frugal.config import EngineConfig, SchedulerConfig

    assert EngineConfig(device="cpu").resolved_batched_tokens() == 2048
    assert EngineConfig(device="cpu", scheduler=SchedulerConfig(
        max_num_batched_tokens=96)).resolved_batched_tokens() == 96
    for gib, want in ((141, 8192), (80, 8192), (48, 2048)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert EngineConfig(device="cuda").resolved_batched_tokens() == want
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
