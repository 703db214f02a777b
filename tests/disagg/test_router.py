"""Prefill/decode disaggregation as users run it: `frugal serve-pd --api-key` (the `system`
fixture, tests/disagg/deployment.py) against a co-located `frugal serve` with the same model,
plus decode workers started with injected faults and one with an FP8 cache, called the way the
router calls them. (The worker killed mid-stream comes last: the deployment is the package's.)"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.disagg.deployment import (
    FLAGS,
    KEYED,
    MAX_TOKENS,
    PROMPTS,
    WORKER_KEY,
    chats,
    client,
    completions,
    completions_of,
    needs_pd,
    prefill,
    wait_empty,
    wait_for_metric,
    wmetrics,
)
from tests.server.conftest import MODEL, start_server, stop_server

needs_pd()
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")


def test_router_outputs_match_colocated(system):
    router, colocated = system["router"], system["colocated"]
    want, got = completions(colocated), completions(router)
    for (text, logprobs), (want_text, want_logprobs) in zip(got, want):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert chats(router) == chats(colocated)
    loads = sum(wmetrics(d)["frugal_kv_transfer_loads_total"] for d in system["decode"])
    assert loads >= 2 * len(PROMPTS)
    # workers of one host: every hand-off copied from the prefill pool mapped into the decode
    # worker (disagg.direct), none over NIXL
    assert sum(wmetrics(d)["frugal_kv_transfer_mapped_loads_total"]
               for d in system["decode"]) == loads
    assert wait_empty(system["prefill"], *system["decode"])


def test_kv_dtype_mismatch_is_refused_at_the_handshake(system):
    status, body = system["fp8"].request("POST", "/v1/completions",
                                         prefill(system, PROMPTS[0]), key=WORKER_KEY)
    assert status == 400, body
    message = body["error"]["message"]
    assert "kv_cache_dtype 'float32' there, 'fp8_e4m3' here" in message, message
    assert body["error"]["param"] == "kv_transfer_params"
    assert wait_empty(system["fp8"], timeout=2)


def test_injected_checksum_fault_fails_only_its_request(tmp_path, system):
    faulty = start_server(tmp_path / "corrupt.log", *FLAGS, "--kv-role", "decode",
                          env={**KEYED, "FRUGAL_KV_FAULTS": "corrupt:2"})
    try:
        bodies = [prefill(system, p) for p in PROMPTS[:3]]
        results = [faulty.request("POST", "/v1/completions", b, key=WORKER_KEY)
                   for b in bodies]
        assert [s for s, _ in results] == [200, 500, 200], results
        message = results[1][1]["error"]["message"]
        assert "checksum" in message and "0x" not in message  # which page, not its checksum
        want = completions_of(system["colocated"], PROMPTS[:3])
        assert [results[0][1]["choices"][0]["text"], results[2][1]["choices"][0]["text"]] == [
            want[0], want[2]]
        assert wmetrics(faulty)["frugal_kv_transfer_failures_total"] == 1
        assert wait_empty(faulty, system["prefill"])
    finally:
        stop_server(faulty)


def test_abort_mid_transfer_leaves_both_pools_full(tmp_path, system):
    slow = start_server(tmp_path / "slow.log", *FLAGS, "--kv-role", "decode",
                        env={**KEYED, "FRUGAL_KV_FAULTS": "delay:3"})
    try:
        body = prefill(system, PROMPTS[3])
        request = urllib.request.Request(slow.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {WORKER_KEY}"})
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(request, timeout=1.0)  # gone while its KV is on its way
        assert wait_for_metric(slow, "frugal_requests_aborted_total", 1)
        assert wmetrics(slow)["frugal_kv_cache_pages_held"] > 0  # the read may still write
        assert wait_empty(slow, system["prefill"])
        assert wmetrics(slow)["frugal_kv_cache_pages_held"] == 0
        assert completions_of(slow, PROMPTS[:1]) == completions_of(system["colocated"],
                                                                   PROMPTS[:1])
    finally:
        stop_server(slow)


def test_a_decode_worker_killed_mid_stream(system):
    """Its streams end with an error; the router sends the next requests to the other one."""
    router = system["router"]
    stream = client(router).completions.create(model=MODEL, prompt="Once upon a time",
                                               max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    victim = next(d for d in system["decode"]
                  if wmetrics(d)["frugal_num_requests_running"] > 0)
    port = victim.url.rsplit(":", 1)[1]
    pid = next(p for p in os.listdir("/proc") if p.isdigit()
               and f"\0--port\0{port}\0--kv-role\0decode\0" in _cmdline(p))
    os.kill(int(pid), signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):  # the stream breaks off
        for _ in chunks:
            pass
    survivor = next(d for d in system["decode"] if d is not victim)
    loads = wmetrics(survivor)["frugal_kv_transfer_loads_total"]
    time.sleep(2.5)  # one failed health check (every second, serve-pd's router flags) marks it
    want = completions_of(system["colocated"], PROMPTS[:4])
    got = [client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text
           for prompt in PROMPTS[:4]]
    assert got == want
    assert wmetrics(survivor)["frugal_kv_transfer_loads_total"] == loads + 4


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""
