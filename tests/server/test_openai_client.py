"""The official openai client against a running `frugal serve` (CPU, fp32, real model)."""

from __future__ import annotations

import math

import pytest

from frugal import SamplingParams
from tests.server.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea,"


def test_chat_greedy_equals_offline(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=64)
    offline = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=64))[0]
    assert r.choices[0].message.content == offline.outputs[0].text
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.created > 0
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_greedy_equals_offline(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=20)
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))[0]
    assert r.choices[0].text == offline.outputs[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    assert r.id.startswith("cmpl-") and r.object == "text_completion"


def test_streaming_chat_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=64)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_streaming_completion_and_usage(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_n_choices_and_seeds(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, temperature=1.0, max_tokens=16, n=2, seed=42)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible
    assert a.choices[0].text != a.choices[1].text  # the two choices differ
    assert a.usage.completion_tokens == 32
    other = client.completions.create(**{**kwargs, "seed": 43})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=30)
    text = full.choices[0].text
    stop = text[10:16]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=30,
                                  stop=[stop, "zzzz"])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=30, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_min_tokens_and_ignore_eos_extras(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=64, extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens >= 20
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "top_k": 5})
    assert r.usage.completion_tokens == 5


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best token
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content[:10])


def test_lm_eval_style_scoring(server, llm):
    """lm-evaluation-harness local-completions: token-id prompts, echo, logprobs=1, max_tokens=1,
    one logprob per prompt token."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode("The capital of France is Paris."), tok.encode("Two plus two is four.")]
    status, body = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True})
    assert status == 200, body
    offline = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0,
                                                   prompt_logprobs=1))
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        ids = prompts[choice["index"]]
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(ids) + 1 and lps["token_logprobs"][0] is None
        assert len(lps["top_logprobs"]) == len(ids) + 1
        ref = offline[choice["index"]].prompt_logprobs
        for p in range(1, len(ids)):
            assert math.isclose(lps["token_logprobs"][p], ref[p].logprob, abs_tol=1e-4)
            assert max(lps["top_logprobs"][p].values()) >= lps["token_logprobs"][p]
        assert choice["text"].startswith(tok.decode(ids, skip_special_tokens=False))


def test_streamed_echo_logprobs_equal_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
                  logprobs=2, echo=True)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == full.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == full.logprobs.token_logprobs
    assert streamed[0] is None and len(streamed) == len(full.logprobs.tokens)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.request("GET", "/health", key=None) == (200, {"status": "ok"})


def test_tokenizer_routes(server, llm):
    status, body = server.request("POST", "/tokenize", {"prompt": "Hello world",
                                                       "add_special_tokens": False})
    assert status == 200 and body["tokens"] == llm.get_tokenizer().encode("Hello world")
    status, body = server.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert body["prompt"] == "Hello world"
    status, info = server.request("GET", "/tokenizer_info")
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]


@pytest.mark.parametrize("key, status", [(None, 401), ("wrong", 401), ("test-key", 200)])
def test_auth(server, key, status):
    got, body = server.request("GET", "/v1/models", key=key)
    assert got == status
    if status == 200:  # the KV cache's dtype and scale source are part of the model card
        card = body["data"][0]
        assert card["kv_cache_dtype"] == "float32" and card["kv_scales"].startswith("none")
    if status == 401:
        assert body["error"]["code"] == "invalid_api_key"
