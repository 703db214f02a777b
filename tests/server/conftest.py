"""A real `frugal serve` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                key: str | None = API_KEY) -> tuple[int, dict | str]:
        """Raw HTTP (no client library): (status, parsed JSON or text)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, raw = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read().decode()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw


def metrics(server, key: str | None = API_KEY) -> dict[str, float]:
    """/metrics as {name: value}; the key is ignored by a server without one."""
    status, text = server.request("GET", "/metrics", key=key)
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finish_reason" in sample.labels:
                key += "{" + sample.labels["finish_reason"] + "}"
            values[key] = sample.value
    return values


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path, *flags: str, env: dict[str, str] | None = None) -> Server:
    """`frugal serve` on a free port with the default model, its output going to `log` (a
    pipe nobody reads would block the server once full); returns once /health answers."""
    port = free_port()
    out = log.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "frugal.cli.main", "serve", "--port", str(port), *flags],
        env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, text=True)
    s = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {s.output()}")
        try:
            if s.request("GET", "/health")[0] == 200:
                return s
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"server did not become healthy: {s.output()}")


def stop_server(s: Server) -> int:
    """SIGTERM, then the exit code."""
    if s.process.poll() is None:
        s.process.send_signal(signal.SIGTERM)
        s.process.wait(timeout=60)
    return s.process.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server") / "serve.log", "--dtype", "float32",
                     "--kv-cache-memory", "128MiB", "--log-level", "WARNING",
                     env={"FRUGAL_API_KEY": API_KEY})
    yield s
    assert stop_server(s) == 0, s.output()


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def async_client(server):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
