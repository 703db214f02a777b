"""A request whose KV pages fail the integrity check, as a client sees it: a 500 with an
OpenAI-style error body, or an error event then [DONE] when streaming; the counter in /metrics
goes up and the server keeps serving. In-process server; the fault is injected on the engine
thread between steps (tests/kv_faults.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frugal.core.page_allocator import PageRef
from frugal.engine.async_engine import AsyncEngine
from frugal.metrics import Metrics
from frugal.server.openai_api import build_app
from tests import kv_faults as faults
from tests.server.conftest import MODEL, free_port, wait_for

uvicorn = pytest.importorskip("uvicorn")

BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty_server(llm):
    """Serves llm's engine; while `budget` > 0, the first page of a request that has two
    output tokens is redirected to a free page (one fault per request)."""
    engine = llm.engine
    state = {"budget": 0}
    inner = engine.step

    def step():
        for request in engine.scheduler.running:
            if state["budget"] > 0 and len(request.output_token_ids) == 2:
                free = engine.scheduler.kv.allocator._free[0]
                faults.redirect(request.page_table, 0, PageRef(free, 0))
                state["budget"] -= 1
        return inner()

    engine.step = step
    metrics = Metrics(MODEL)
    app = build_app(AsyncEngine(engine, metrics), MODEL, None, metrics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(30)
    del engine.step


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def integrity_failures(url) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "frugal_kv_integrity_failures_total":
                return sample.value
    raise AssertionError("no frugal_kv_integrity_failures_total in /metrics")


def test_non_streaming_gets_a_500_error_body(faulty_server):
    url, state = faulty_server
    before = integrity_failures(url)
    state["budget"] = 1
    status, raw = post(url, BODY)
    assert status == 500
    error = json.loads(raw)["error"]
    assert error["type"] == "server_error"
    assert "KV cache integrity check failed: page" in error["message"]
    # (the engine thread counts it just after answering: under load /metrics can be a step late)
    assert wait_for(lambda: integrity_failures(url) == before + 1, timeout=5)
    status, raw = post(url, BODY)  # the next request is served normally
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"


def test_streaming_gets_an_error_event_then_done(faulty_server):
    url, state = faulty_server
    state["budget"] = 1
    status, raw = post(url, {**BODY, "stream": True})
    assert status == 200
    events = [line.removeprefix("data: ") for line in raw.splitlines() if line.startswith("data")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "KV cache integrity check failed: page" in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
