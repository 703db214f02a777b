"""What the router-level tests share (the `system` fixture, one deployment for the package):
`frugal serve-pd --api-key` (one prefill and two decode workers behind vllm-router from PyPI and
frugal's key-checking relay, NIXL over UCX between processes on 127.0.0.1, one secret for the
deployment), a co-located `frugal serve` with the same model, and a decode worker with an FP8
cache; and helpers to call them as the router and clients do."""

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

from tests.server.conftest import API_KEY, MODEL, Server, metrics, start_server, stop_server


def needs_pd() -> None:
    """Skip unless NIXL, the openai client and vllm-router (the pd extra) are installed."""
    pytest.importorskip("nixl_cu13")
    pytest.importorskip("openai")
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


@pytest.fixture(scope="package")
def system(tmp_path_factory):
    needs_pd()
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
                  "--calibration-file", str(calibration_text(logs)), "--kv-cache-check", "off"),
                 {"env": KEYED})]
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
    import openai

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


def completions_of(server: Server, prompts: list[str]) -> list[str]:
    """Greedy texts from a worker (or the keyless co-located server)."""
    return [server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
        key=WORKER_KEY)[1]["choices"][0]["text"] for p in prompts]


def wmetrics(server: Server) -> dict[str, float]:
    return metrics(server, WORKER_KEY)


def wait_for_metric(server: Server, name: str, value: float, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if wmetrics(server).get(name, 0) >= value:
            return True
        time.sleep(0.1)
    return False


def get(server: Server, path: str, headers: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(server.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def prefill_params(system, prompt: str) -> dict:
    return prefill(system, prompt)["kv_transfer_params"]


