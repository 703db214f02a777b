"""Requests as large as the body cap allows (16 MiB) against the live server: the work they cause
runs off the event loop or is refused before it starts, so /health (and every other client)
is answered meanwhile."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from tests.server.conftest import API_KEY, MODEL

COMPACT = (",", ":")  # 8 M ids in 16 MB: "1," each


def worst_health_while(server, path: str, body: bytes) -> tuple[tuple, float, float]:
    """POST body from a thread and poll /health until it is answered: (its (status, parsed
    body), its seconds, the slowest /health answer in seconds). The answer is parsed after the
    polling: json.loads of 45 MB would hold this process's GIL, and the poller with it."""
    result: dict = {}

    def send() -> None:
        start = time.monotonic()
        req = urllib.request.Request(server.url + path, body, {
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                result["answer"] = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            result["answer"] = e.code, e.read()
        result["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    worst = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert server.request("GET", "/health", key=None)[0] == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.02)
    sender.join()
    status, raw = result["answer"]
    return (status, json.loads(raw)), result["seconds"], worst


def max_model_len(server) -> int:
    return server.request("GET", "/v1/models")[1]["data"][0]["max_model_len"]


def test_health_answers_while_a_15_mb_tokenize_is_answered(server):
    """7.5 M tokens: more than the context holds, which the text's length alone proves, so it
    is refused before it is tokenized (encoding it on the event loop held /health for 13 s; in
    the thread pool, its ids' list and its encoding's release still held the GIL for ~0.6 s). A
    text within the context is answered in the thread pool, its JSON made a slice at a time."""
    body = json.dumps({"prompt": "x " * 7_500_000}).encode()
    (status, answer), _, worst = worst_health_while(server, "/tokenize", body)
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert worst < 0.1, worst
    limit = max_model_len(server)
    status, answer = server.request("POST", "/tokenize", {"prompt": "x " * (limit - 8)})
    assert status == 200 and limit - 8 <= answer["count"] == len(answer["tokens"]) <= limit
    status, answer = server.request("POST", "/tokenize", {"prompt": "x " * (limit + 8)})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


def test_detokenize_of_more_ids_than_the_context_is_400_at_once(server):
    limit = max_model_len(server)
    status, err = server.request("POST", "/detokenize", {"tokens": [1] * (limit + 1)})
    assert status == 400 and err["error"]["param"] == "tokens", err
    assert server.request("POST", "/detokenize", {"tokens": [1] * limit})[0] == 200
    body = json.dumps({"tokens": [1] * 7_500_000}, separators=COMPACT).encode()
    (status, err), seconds, worst = worst_health_while(server, "/detokenize", body)
    assert status == 400 and err["error"]["param"] == "tokens", err
    assert seconds < 3 and worst < 1.5, (seconds, worst)


def test_a_token_id_prompt_longer_than_the_context_is_400_at_once(server):
    """8 M ids: parsed and validated on a pool thread (on the event loop, FastAPI's way, /health
    waited 2.0-2.5 s on 2 busy cores), one form of prompt validated, not all four (7 s), and the
    ids counted before each is checked."""
    body = json.dumps({"model": MODEL, "prompt": [1] * 8_000_000}, separators=COMPACT).encode()
    (status, err), seconds, worst = worst_health_while(server, "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "prompt", err
    assert err["error"]["code"] == "context_length_exceeded"
    assert seconds < 3 and worst < 1.5, (seconds, worst)


def test_stop_strings_are_capped_in_total_length(server):
    """16 stop strings of 1 MB each (within the 16 MiB body cap) would be searched for in the
    request's text at every step, slowing every request in its batch."""
    status, err = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "stop": ["x" * 1_000_000] * 16})
    assert status == 400 and err["error"]["param"] == "stop", err
    status, err = server.request("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "stop": "y" * 4097})
    assert status == 400 and err["error"]["param"] == "stop", err
    status, _ = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "stop": ["z" * 256] * 16})
    assert status == 200
