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

import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Server:
    url: str
    process: subprocess.Popen

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    port = free_port()
    env = {**os.environ, "FRUGAL_API_KEY": API_KEY}
    process = subprocess.Popen(
        [sys.executable, "-m", "frugal.cli.main", "serve", "--port", str(port), "--dtype",
         "float32", "--kv-cache-memory", "128MiB", "--log-level", "WARNING"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s = Server(f"http://127.0.0.1:{port}", process)
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read()}")
        try:
            if s.request("GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        process.kill()
        raise RuntimeError("server did not become healthy")
    yield s
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, process.stdout.read()


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def async_client(server):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
