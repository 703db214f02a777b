"""Clients that try to turn disaggregated workers against each other, against `frugal serve-pd
--api-key` with the secret on (the `system` fixture, tests/disagg/deployment.py): unkeyed
clients, the KV side channel without the secret, made-up and altered hand-offs (reading or
poisoning through a decode worker), pinning a prefill worker's pool, and a prefill worker that
dies between a hand-off and its read."""

from __future__ import annotations

import json
import time

from frugal.disagg.signing import Signer
from tests.disagg.deployment import (
    FLAGS,
    KEYED,
    MAX_TOKENS,
    PROMPTS,
    SECRET,
    WORKER_KEY,
    completions_of,
    get,
    needs_pd,
    prefill_params,
    wait_empty,
    wmetrics,
)
from tests.server.conftest import MODEL, start_server, stop_server

needs_pd()


def test_serve_pd_with_a_key_refuses_unkeyed_clients(system):
    """The relay refuses clients without the key, and so does every worker; the router's own
    calls (with the deployment's worker key as $OPENAI_API_KEY) go through, which the other
    tests show. A client's key does not open a worker: no client can reach one."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    for server in (system["router"], system["prefill"], *system["decode"]):
        status, answer = server.request("POST", "/v1/completions", body, key=None)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
        assert server.request("POST", "/v1/completions", body, key="wrong")[0] == 401
    for worker in (system["prefill"], *system["decode"]):
        assert worker.request("POST", "/v1/completions", body)[0] == 401  # the client's key
    assert system["router"].request("POST", "/v1/completions", body)[0] == 200
    status, answer = system["router"].request("GET", "/kv/handshake")  # not relayed
    assert status == 404, answer


def test_the_kv_side_channel_needs_the_secret(system):
    """No metadata (the pool's address, NIXL's keys to it) for anyone without the secret."""
    prefill = system["prefill"]
    for headers in ({}, {"X-Frugal-KV-Auth": Signer("not-the-deployment-secret").token(
            "handshake")}, {"X-Frugal-KV-Auth": "1.2.3"}):
        status, body = get(prefill, "/kv/handshake", headers)
        assert status == 401 and "agent_metadata" not in str(body), body
    status, body = get(prefill, "/kv/handshake",
                        {"X-Frugal-KV-Auth": Signer(SECRET).token("handshake")})
    assert status == 200 and "agent_metadata" in body


SECRET_PROMPT = "The launch code is 7 3 1 9. Repeat the launch code: 7 3"
FRANCE = "Answer in one word. The capital of France is"


def test_a_client_cannot_read_or_poison_through_a_decode_worker(system):
    """With a victim's pages held for a decode worker, an attacker's made-up or altered params
    get one 400 that says nothing (no checksum), before any read; the victim's own hand-off
    still decodes, and a plain request's answer is the co-located one afterwards. (The attacker
    holds the worker key, which clients do not: the signatures stand even against it.)"""
    decode, prefill = system["decode"][0], system["prefill"]
    want_france = completions_of(system["colocated"], [FRANCE])
    victim = prefill_params(system, SECRET_PROMPT)
    mine = prefill_params(system, FRANCE)
    attempts = [
        {**mine, "remote_block_ids": victim["remote_block_ids"][:len(mine["remote_block_ids"])]},
        {**mine, "page_checksums": victim["page_checksums"][:len(mine["page_checksums"])]},
        {**mine, "remote_host": "127.0.0.1", "remote_port": 1},
        {k: v for k, v in mine.items() if k != "frugal_signature"},
        {**mine, "prompt_sha256": victim["prompt_sha256"]},
    ]
    loads = wmetrics(decode)["frugal_kv_transfer_loads_total"]
    for params in attempts:
        status, body = decode.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": FRANCE, "max_tokens": MAX_TOKENS, "temperature": 0,
            "kv_transfer_params": params}, key=WORKER_KEY)
        assert status == 400 and body["error"]["param"] == "kv_transfer_params", body
        text = json.dumps(body)
        assert not any(str(c) in text for c in victim["page_checksums"] + mine["page_checksums"])
    assert wmetrics(decode)["frugal_kv_transfer_loads_total"] == loads  # nothing was read
    ok = decode.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "kv_transfer_params": victim}, key=WORKER_KEY)
    assert ok[0] == 200 and ok[1]["choices"][0]["text"] == completions_of(
        system["colocated"], [SECRET_PROMPT])[0]
    replay = decode.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "kv_transfer_params": victim}, key=WORKER_KEY)
    assert replay[0] == 400, replay
    assert completions_of(decode, [FRANCE]) == want_france
    status, body = decode.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": FRANCE, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}, key=WORKER_KEY)
    assert status == 400 and "decode worker" in body["error"]["message"]
    decode.request("POST", "/v1/completions", {  # frees the lease the attempts left
        "model": MODEL, "prompt": FRANCE, "max_tokens": MAX_TOKENS, "temperature": 0,
        "kv_transfer_params": mine}, key=WORKER_KEY)
    assert wait_empty(prefill, decode)


def test_pinning_gets_503_and_plain_requests_are_served(tmp_path):
    """Prefills for decode workers past --kv-max-held-fraction (half of a 91-page pool) get a
    503 with the error body; the pages they hold leave a plain request its half of the pool."""
    worker = start_server(tmp_path / "pin.log", *FLAGS, "--kv-role", "prefill", env=KEYED)
    try:
        start = time.monotonic()
        completions_of(worker, PROMPTS[:1])
        alone = time.monotonic() - start
        statuses = []
        for _ in range(8):
            status, body = worker.request("POST", "/v1/completions", {
                "model": MODEL, "prompt": " ".join(["pin"] * 170), "max_tokens": 1,  # 11 pages
                "kv_transfer_params": {"do_remote_decode": True}}, key=WORKER_KEY)
            statuses.append(status)
            if status == 503:
                assert body["error"]["code"] == "kv_pages_held", body
                assert "--kv-max-held-fraction" in body["error"]["message"]
        assert statuses.count(200) == 4 and statuses.count(503) == 4, statuses
        assert wmetrics(worker)["frugal_kv_cache_pages_held"] == 44
        start = time.monotonic()
        status, body = worker.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": " ".join(["plain"] * 600), "max_tokens": 4},  # 38 pages
            key=WORKER_KEY)
        assert status == 200, body
        assert time.monotonic() - start < alone + 10.0
    finally:
        stop_server(worker)


def test_a_prefill_worker_that_dies_fails_only_its_hand_offs(tmp_path, system):
    """A decode worker whose prefill worker died between the hand-off and the read fails that
    request alone and goes on serving (its pool, mapped into the decode worker, is unmapped:
    the read goes to NIXL, which finds nobody)."""
    doomed = start_server(tmp_path / "doomed.log", *FLAGS, "--kv-role", "prefill", env=KEYED)
    decode = system["decode"][0]

    def decode_of(params: dict) -> tuple[int, dict]:
        return decode.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": PROMPTS[5], "max_tokens": MAX_TOKENS, "temperature": 0,
            "kv_transfer_params": params}, key=WORKER_KEY)

    try:
        handoffs = []
        for _ in range(2):
            status, body = doomed.request("POST", "/v1/completions", {
                "model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}, key=WORKER_KEY)
            assert status == 200, body
            handoffs.append(body["kv_transfer_params"])
        assert decode_of(handoffs[0])[0] == 200  # connected (one host: its pool mapped)
    finally:
        doomed.process.kill()
        doomed.process.wait()
    status, body = decode_of(handoffs[1])
    assert status in (500, 502) and "error" in body, body
    time.sleep(2.5)  # (a dead engine's server would be gone by now)
    assert decode.request("GET", "/health")[0] == 200
    assert completions_of(decode, PROMPTS[:2]) == completions_of(system["colocated"], PROMPTS[:2])
    assert wait_empty(decode)
