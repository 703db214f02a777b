"""Prefill/decode disaggregation as users run it: `frugal serve-pd --api-key` (one prefill and two
decode workers behind vllm-router from PyPI and frugal's key-checking relay, NIXL over UCX
between processes on 127.0.0.1, one secret for the deployment), against a co-located `frugal
serve` with the same model; plus decode workers started with injected faults and one with an
FP8 cache, called the way the router calls them; and clients that try to turn the workers
against each other."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from frugal.disagg.signing import Signer
from tests.server.conftest import API_KEY, MODEL, Server, metrics, start_server, stop_server

pytest.importorskip("nixl_cu13")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "vllm-router")):
    pytest.skip("vllm-router is not installed (the pd extra)", allow_module_level=True)

FLAGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
SECRET = "secret-of-the-test-deployment"
WORKER_KEY = "worker-key-of-the-test-deployment"  # the router's and workers' (not clients')
KEYED = {"FRUGAL_API_KEY": WORKER_KEY, "FRUGAL_KV_SECRET": SECRET}  # workers the tests start
PROMPTS = [f"{start} {topic}" for start in ("Tell me about", "Write one sentence on",
                                            "What do you know about", "Describe")
           for topic in ("the sea.", "Paris, the capital of France, and its river", "bread",
                         "a long walk through the mountains on a cold day in winter")]
MAX_TOKENS = 8


def free_ports(n: int) -> int:
    """A base port with the n ports from it free (serve-pd takes consecutive ones), below the
    ephemeral range the other servers' ports come from, so none of them can take one of these
    before serve-pd's workers bind them."""
    for base in range(20000 + os.getpid() % 5000, 30000, 7):
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    base = free_ports(5)  # relay, prefill, 2 decode, the router behind the relay
    log = (logs / "serve-pd.log").open("w")
    pd = subprocess.Popen(
        [sys.executable, "-m", "frugal.cli.main", "serve-pd", "--port", str(base),
         "--num-decode", "2", "--args", " ".join(FLAGS), "--prefill-args",
         "--kv-lease-timeout 10", "--log-level", "WARNING", "--api-key", API_KEY],
        stdout=log, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "FRUGAL_KV_SECRET": SECRET, "FRUGAL_WORKER_KEY": WORKER_KEY},
        start_new_session=True)
    started = []
    try:
        jobs = [((logs / "colocated.log", *FLAGS), {}),
                ((logs / "fp8.log", *FLAGS, "--kv-role", "decode", "--kv-cache-dtype", "fp8",
                  "--calibration-file", str(calibration_text(logs))), {"env": KEYED})]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_server, *a, **kw) for a, kw in jobs]
            for future in futures:
                try:
                    started.append(future.result())
                except Exception:
                    started.append(None)
        assert None not in started, "a server of the fixture did not start"
        colocated, fp8 = started
        urls = [f"http://127.0.0.1:{base + i}" for i in range(4)]
        router, prefill, decode = (Server(urls[0], pd, logs / "serve-pd.log"),
                                   Server(urls[1], pd, logs / "serve-pd.log"),
                                   [Server(u, pd, logs / "serve-pd.log") for u in urls[2:]])
        deadline = time.time() + 300
        while time.time() < deadline and not _ready(router):
            assert pd.poll() is None, router.output()
            time.sleep(0.5)
        assert _ready(router), router.output()
        yield {"router": router, "prefill": prefill, "decode": decode, "colocated": colocated,
               "fp8": fp8}
        pd.send_signal(signal.SIGTERM)
        assert pd.wait(timeout=60) == 0, router.output()
    finally:
        for s in started:
            if s is not None:
                stop_server(s)
        try:  # whatever happened, nothing of serve-pd's outlives the module
            os.killpg(pd.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pd.wait()


def calibration_text(folder) -> str:
    """A small fixed text for FP8 KV scales: a forward pass, not 8 prompts' greedy tokens."""
    path = folder / "calibration.txt"
    path.write_text(" ".join(PROMPTS) * 4)
    return path


def _ready(router: Server) -> bool:
    try:
        return router.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hi", "max_tokens": 1})[0] == 200
    except OSError:
        return False


def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def completions(server: Server) -> list[tuple[str, list[float]]]:
    c = client(server)

    def one(prompt):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                 temperature=0, logprobs=1)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


def chats(server: Server) -> list[str]:
    c = client(server)

    def one(prompt):
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, logprobs=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


def test_router_outputs_match_colocated(system):
    router, colocated = system["router"], system["colocated"]
    want, got = completions(colocated), completions(router)
    for (text, logprobs), (want_text, want_logprobs) in zip(got, want):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert chats(router) == chats(colocated)
    loads = sum(wmetrics(d)["frugal_kv_transfer_loads_total"] for d in system["decode"])
    assert loads >= 2 * len(PROMPTS)
    assert wait_empty(system["prefill"], *system["decode"])


def prefill(system, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """What the router sends a prefill worker, and the params it hands the decode side."""
    status, body = system["prefill"].request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
        key=WORKER_KEY)
    assert status == 200, body
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "kv_transfer_params": body["kv_transfer_params"]}


def wait_empty(*servers: Server, timeout: float = 20.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(wmetrics(s)["frugal_kv_cache_pages_used"] == 0 for s in servers):
            return True
        time.sleep(0.2)
    return False


def test_kv_dtype_mismatch_is_refused_at_the_handshake(system):
    status, body = system["fp8"].request("POST", "/v1/completions",
                                         prefill(system, PROMPTS[0]), key=WORKER_KEY)
    assert status == 400, body
    message = body["error"]["message"]
    assert "kv_cache_dtype 'float32' there, 'float8_e4m3fn' here" in message, message
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


def completions_of(server: Server, prompts: list[str]) -> list[str]:
    """Greedy texts from a worker (or the keyless co-located server)."""
    return [server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
        key=WORKER_KEY)[1]["choices"][0]["text"] for p in prompts]


def wmetrics(server: Server) -> dict[str, float]:
    return metrics(server, WORKER_KEY)


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


def wait_for_metric(server: Server, name: str, value: float, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if wmetrics(server).get(name, 0) >= value:
            return True
        time.sleep(0.1)
    return False


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
        status, body = _get(prefill, "/kv/handshake", headers)
        assert status == 401 and "agent_metadata" not in str(body), body
    status, body = _get(prefill, "/kv/handshake",
                        {"X-Frugal-KV-Auth": Signer(SECRET).token("handshake")})
    assert status == 200 and "agent_metadata" in body


def _get(server: Server, path: str, headers: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(server.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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


def prefill_params(system, prompt: str) -> dict:
    return prefill(system, prompt)["kv_transfer_params"]


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
    request alone and goes on serving."""
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
        assert decode_of(handoffs[0])[0] == 200  # connected: the next read goes over NIXL
    finally:
        doomed.process.kill()
        doomed.process.wait()
    status, body = decode_of(handoffs[1])
    assert status in (500, 502) and "error" in body, body
    time.sleep(2.5)  # (a dead engine's server would be gone by now)
    assert decode.request("GET", "/health")[0] == 200
    assert completions_of(decode, PROMPTS[:2]) == completions_of(system["colocated"], PROMPTS[:2])
    assert wait_empty(decode)


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
