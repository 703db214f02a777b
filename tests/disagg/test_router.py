"""Prefill/decode disaggregation as users run it: `frugal serve-pd` (one prefill and two decode
workers behind vllm-router from PyPI, NIXL over UCX between processes on 127.0.0.1), against a
co-located `frugal serve` with the same model; plus decode workers started with injected faults
and one with an FP8 cache, called the way the router calls them."""

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

from tests.server.conftest import MODEL, Server, metrics, start_server, stop_server

pytest.importorskip("nixl_cu13")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "vllm-router")):
    pytest.skip("vllm-router is not installed (the pd extra)", allow_module_level=True)

FLAGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "WARNING"]
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
    base = free_ports(4)
    log = (logs / "serve-pd.log").open("w")
    pd = subprocess.Popen(
        [sys.executable, "-m", "frugal.cli.main", "serve-pd", "--port", str(base),
         "--num-decode", "2", "--args", " ".join(FLAGS), "--prefill-args",
         "--kv-lease-timeout 10", "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    others = concurrent.futures.ThreadPoolExecutor(2).map(lambda a: start_server(*a), [
        (logs / "colocated.log", *FLAGS),
        (logs / "fp8.log", *FLAGS, "--kv-role", "decode", "--kv-cache-dtype", "fp8")])
    colocated, fp8 = list(others)
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
    for s in (colocated, fp8):
        stop_server(s)


def _ready(router: Server) -> bool:
    try:
        return router.request("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hi", "max_tokens": 1}, key=None)[0] == 200
    except OSError:
        return False


def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
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
    loads = sum(metrics(d)["frugal_kv_transfer_loads_total"] for d in system["decode"])
    assert loads >= 2 * len(PROMPTS)
    assert wait_empty(system["prefill"], *system["decode"])


def prefill(system, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """What the router sends a prefill worker, and the params it hands the decode side."""
    status, body = system["prefill"].request("POST", "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}, key=None)
    assert status == 200, body
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "kv_transfer_params": body["kv_transfer_params"]}


def wait_empty(*servers: Server, timeout: float = 20.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(metrics(s)["frugal_kv_cache_pages_used"] == 0 for s in servers):
            return True
        time.sleep(0.2)
    return False


def test_kv_dtype_mismatch_is_refused_at_the_handshake(system):
    status, body = system["fp8"].request("POST", "/v1/completions",
                                         prefill(system, PROMPTS[0]), key=None)
    assert status == 400, body
    message = body["error"]["message"]
    assert "kv_cache_dtype 'float32' there, 'float8_e4m3fn' here" in message, message
    assert body["error"]["param"] == "kv_transfer_params"
    assert wait_empty(system["fp8"], timeout=2)


def test_injected_checksum_fault_fails_only_its_request(tmp_path, system):
    faulty = start_server(tmp_path / "corrupt.log", *FLAGS, "--kv-role", "decode",
                          env={"FRUGAL_KV_FAULTS": "corrupt:2"})
    try:
        bodies = [prefill(system, p) for p in PROMPTS[:3]]
        results = [faulty.request("POST", "/v1/completions", b, key=None) for b in bodies]
        assert [s for s, _ in results] == [200, 500, 200], results
        assert "checksum" in results[1][1]["error"]["message"]
        want = completions_of(system["colocated"], PROMPTS[:3])
        assert [results[0][1]["choices"][0]["text"], results[2][1]["choices"][0]["text"]] == [
            want[0], want[2]]
        assert metrics(faulty)["frugal_kv_transfer_failures_total"] == 1
        assert wait_empty(faulty, system["prefill"])
    finally:
        stop_server(faulty)


def completions_of(server: Server, prompts: list[str]) -> list[str]:
    return [server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
        key=None)[1]["choices"][0]["text"] for p in prompts]


def test_abort_mid_transfer_leaves_both_pools_full(tmp_path, system):
    slow = start_server(tmp_path / "slow.log", *FLAGS, "--kv-role", "decode",
                        env={"FRUGAL_KV_FAULTS": "delay:3"})
    try:
        body = prefill(system, PROMPTS[3])
        request = urllib.request.Request(slow.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(request, timeout=1.0)  # gone while its KV is on its way
        assert wait_for_metric(slow, "frugal_requests_aborted_total", 1)
        assert metrics(slow)["frugal_kv_cache_pages_held"] > 0  # the read may still write
        assert wait_empty(slow, system["prefill"])
        assert metrics(slow)["frugal_kv_cache_pages_held"] == 0
        assert completions_of(slow, PROMPTS[:1]) == completions_of(system["colocated"],
                                                                   PROMPTS[:1])
    finally:
        stop_server(slow)


def wait_for_metric(server: Server, name: str, value: float, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics(server).get(name, 0) >= value:
            return True
        time.sleep(0.1)
    return False


def test_a_decode_worker_killed_mid_stream(system):
    """Its streams end with an error; the router sends the next requests to the other one."""
    router = system["router"]
    stream = client(router).completions.create(model=MODEL, prompt="Once upon a time",
                                               max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    victim = next(d for d in system["decode"]
                  if metrics(d)["frugal_num_requests_running"] > 0)
    port = victim.url.rsplit(":", 1)[1]
    pid = next(p for p in os.listdir("/proc") if p.isdigit()
               and f"\0--port\0{port}\0--kv-role\0decode\0" in _cmdline(p))
    os.kill(int(pid), signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):  # the stream breaks off
        for _ in chunks:
            pass
    survivor = next(d for d in system["decode"] if d is not victim)
    loads = metrics(survivor)["frugal_kv_transfer_loads_total"]
    time.sleep(2.5)  # one failed health check (every second, serve-pd's router flags) marks it
    want = completions_of(system["colocated"], PROMPTS[:4])
    got = [client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text
           for prompt in PROMPTS[:4]]
    assert got == want
    assert metrics(survivor)["frugal_kv_transfer_loads_total"] == loads + 4


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""
