"""Many clients, a client that walks away, bad input, metrics and shutdown on a live server."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

import pytest

from tests.server.conftest import API_KEY, MODEL, metrics, start_server, wait_for


def test_16_streams_complete_while_one_disconnects(server, async_client, llm):
    before = metrics(server)
    prompts = [f"Story number {i}: once upon a time" for i in range(16)]

    async def stream(prompt: str, max_tokens: int) -> tuple[int, int, str]:
        s = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=1,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, usage = 0, None
        async for chunk in s:
            if chunk.choices:
                pieces += 1
            if chunk.usage:
                usage = chunk.usage
        return pieces, usage.completion_tokens, usage.prompt_tokens

    async def walk_away() -> int:
        s = await async_client.completions.create(
            model=MODEL, prompt="A very long story:", max_tokens=2000, temperature=0.7,
            stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in s:
            seen += 1
            if seen == 3:
                break
        await s.close()
        return seen

    async def run():
        return await asyncio.gather(walk_away(), *(stream(p, 24) for p in prompts))

    walked, *results = asyncio.run(run())
    assert walked == 3
    tok = llm.get_tokenizer()
    for (pieces, completion_tokens, prompt_tokens), prompt in zip(results, prompts):
        assert completion_tokens == 24 and 1 <= pieces <= 24  # a chunk may carry several tokens
        assert prompt_tokens == len(tok.encode(prompt))
    # the walked-away request was aborted and its pages are back
    assert wait_for(lambda: metrics(server)["frugal_requests_aborted_total"]
                    == before["frugal_requests_aborted_total"] + 1)
    after = metrics(server)
    assert after["frugal_kv_cache_pages_used"] == 0
    assert after["frugal_kv_cache_capacity_ratio"] == 1.0 and after["frugal_kv_cache_info"] == 1
    assert after["frugal_num_requests_running"] == 0
    assert after["frugal_requests_finished_total{length}"] >= (
        before.get("frugal_requests_finished_total{length}", 0) + 16)
    generated = after["frugal_generation_tokens_total"] - before["frugal_generation_tokens_total"]
    assert generated >= 16 * 24
    assert after["frugal_time_to_first_token_seconds_count"] >= (
        before["frugal_time_to_first_token_seconds_count"] + 16)


def test_disconnect_frees_pages_at_once(server):
    """Pages held by a streaming request drop to zero right after the client closes."""
    req = urllib.request.Request(server.url + "/v1/completions", method="POST", data=json.dumps({
        "model": MODEL, "prompt": "Tell me everything:", "max_tokens": 2000, "stream": True,
        "ignore_eos": True}).encode(), headers={"Content-Type": "application/json",
                                               "Authorization": f"Bearer {API_KEY}"})
    resp = urllib.request.urlopen(req, timeout=60)
    for _ in range(5):
        resp.readline()
    assert metrics(server)["frugal_kv_cache_pages_used"] > 0
    resp.close()
    assert wait_for(lambda: metrics(server)["frugal_kv_cache_pages_used"] == 0, timeout=10)


BAD = [
    (b"{not json", 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": 12}, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "word " * 9000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 10**4}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stop": 5}, 400, "stop"),
    ({"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 1, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**64}, 400, "seed"),
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": NaN}', 400,
     "temperature"),
    ({"model": MODEL, "prompt": "\ud800 x"}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["ok", "a\udfff"]}, 400, "prompt.1"),
    ({"model": "\ud800", "prompt": "hi"}, 400, "model"),
    ({"model": MODEL, "prompt": "hi", "stop": ["\ud800"]}, 400, "stop.0"),
    ({"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ({"model": MODEL, "prompt": ["hi"] * 1025}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ({"model": MODEL, "prompt": "hi", "cache_salt": 5}, 400, "cache_salt"),
]


def test_prefix_cache_hits_are_counted_and_kept_apart_by_salt(server):
    prompt = "A long shared system prompt about caching, pages and tags. " * 4

    def hits_after(salt: str) -> tuple[float, float]:
        ok, _ = server.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": salt})
        assert ok == 200
        m = metrics(server)
        return m["frugal_prefix_cache_queries_total"], m["frugal_prefix_cache_hits_total"]

    q0, h0 = hits_after("tenant-a")
    q1, h1 = hits_after("tenant-a")
    q2, h2 = hits_after("tenant-b")
    assert q1 > q0 and h1 - h0 >= 32  # the same tenant reads the prompt's full pages
    assert q2 > q1 and h2 == h1  # another salt shares nothing


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_completion_input_is_4xx_and_harmless(server, body, status, param):
    got, err = server.request("POST", "/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and err["error"]["message"]
    ok, body = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                          "max_tokens": 2})
    assert ok == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "max_completion_tokens": 10**6}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]},
     "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "max_completion_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x\udc00"}]}]}, "messages.0.content.0.text"),
])
def test_bad_chat_input_is_400(server, body, param):
    got, err = server.request("POST", "/v1/chat/completions", body)
    assert got == 400, err
    assert err["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": "\ud800 x"}, "prompt"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
])
def test_tokenize_refuses_invalid_unicode(server, body, param):
    got, err = server.request("POST", "/tokenize", body)
    assert got == 400 and err["error"]["param"] == param, err


def test_tokenize_messages_counts_what_chat_sends(server):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, tokens = server.request("POST", "/tokenize", {"messages": messages})
    _, chat = server.request("POST", "/v1/chat/completions", {"model": MODEL,
                                                              "messages": messages,
                                                              "max_tokens": 1})
    assert tokens["count"] == chat["usage"]["prompt_tokens"]


def test_unknown_route_is_openai_shaped_404(server):
    got, err = server.request("GET", "/v1/nothing")
    assert got == 404 and "error" in err


def test_sigterm_finishes_in_flight_request_and_exits_0(tmp_path):
    s = start_server(tmp_path / "serve.log", "--kv-cache-memory", "64MiB", "--log-level",
                     "WARNING")
    req = urllib.request.Request(s.url + "/v1/completions", method="POST", data=json.dumps({
        "model": MODEL, "prompt": "Count:", "max_tokens": 40, "stream": True,
        "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()
    s.process.send_signal(signal.SIGTERM)
    rest = resp.read().decode()
    assert rest.rstrip().endswith("data: [DONE]")  # the stream was allowed to finish
    assert 'data: {"error"' not in rest
    assert s.process.wait(timeout=60) == 0
