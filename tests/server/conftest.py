"""A real `frugal serve` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import atexit
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
                key: str | None = API_KEY, timeout: float = 120) -> tuple[int, dict | str]:
        """Raw HTTP (no client library): (status, parsed JSON or text)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
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


_STARTED: list[subprocess.Popen] = []  # every server's process group, killed at exit at last


def start_server(log: Path, *flags: str, env: dict[str, str] | None = None,
                 timeout: float = 180.0) -> Server:
    """`frugal serve` on a free port with the default model, its output going to `log` (a
    pipe nobody reads would block the server once full), in a process group of its own;
    returns once /health answers. A server that exits or is not healthy within `timeout` is
    killed with all its processes (tensor-parallel ranks too) before the error is raised."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "frugal.cli.main", "serve", "--port", str(port), *flags],
            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
    _STARTED.append(process)
    s = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        try:
            if s.request("GET", "/health", timeout=5)[0] == 200:
                return s
        except OSError:
            pass
        time.sleep(0.5)
    kill_group(process)
    raise RuntimeError(f"server did not become healthy (exit code {process.returncode}): "
                       f"{s.output()[-3000:]}")


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a server's whole process group (it leads one: start_server) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def stop_server(s: Server) -> int:
    """SIGTERM, then the exit code; whatever of its group is left is killed."""
    if s.process.poll() is None:
        s.process.send_signal(signal.SIGTERM)
        try:
            s.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    code = s.process.poll()
    kill_group(s.process)
    return s.process.returncode if code is None else code


@atexit.register
def _kill_leftovers() -> None:
    for process in _STARTED:
        kill_group(process)


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
