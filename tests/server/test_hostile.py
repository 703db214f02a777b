"""A hostile or careless client against a live `frugal serve`: clients that leave without
reading, huge bodies, a full queue, a shutdown that outlasts its timeout, a dead engine, bad
flags. Each gets a clear answer, and nothing else breaks."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from tests.server.conftest import (
    API_KEY,
    MODEL,
    free_port,
    metrics,
    start_server,
    stop_server,
    wait_for,
)

LONG = {"model": MODEL, "prompt": "Count:", "max_tokens": 1000, "ignore_eos": True}


def raw_post(url: str, path: str, body: dict | bytes, key: str | None = None,
             rcvbuf: int | None = None) -> socket.socket:
    """Send a POST on a plain socket and return the socket, unread."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    where = urllib.parse.urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((where.hostname, where.port))
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"{auth}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_all(sock: socket.socket, timeout: float = 300) -> bytes:
    """The whole response: to its Content-Length, else (a stream) to the end."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n") if sep else ():
            if line.lower().startswith(b"content-length:") and len(body) >= int(line[15:]):
                return data
    return data


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No API key, one request at a time in the batch, at most 2 waiting."""
    s = start_server(tmp_path_factory.mktemp("open") / "serve.log", "--dtype", "float32",
                     "--kv-cache-memory", "64MiB", "--max-num-seqs", "1",
                     "--max-queued-requests", "2", "--log-level", "WARNING")
    yield s
    assert stop_server(s) == 0, s.output()


def _abort_on_disconnect(server, key):
    before = metrics(server)
    sock = raw_post(server.url, "/v1/completions", LONG, key)
    assert wait_for(lambda: metrics(server)["frugal_num_requests_running"] == 1, timeout=30)
    sock.close()
    left = time.monotonic()
    assert wait_for(lambda: metrics(server)["frugal_num_requests_running"] == 0, timeout=5)
    assert time.monotonic() - left < 1.0
    after = metrics(server)
    assert after["frugal_kv_cache_pages_used"] == 0
    assert after["frugal_requests_aborted_total"] == before["frugal_requests_aborted_total"] + 1


def test_non_streaming_disconnect_aborts_within_a_second_with_api_key(server):
    _abort_on_disconnect(server, API_KEY)


def test_non_streaming_disconnect_aborts_within_a_second_without_api_key(open_server):
    _abort_on_disconnect(open_server, None)


# a /health answer while the event loop is free: well under what a blocked loop takes (reading
# or tokenizing the bodies below: seconds), above a loaded 2-core machine's noise (0.105 s seen)
HEALTH_BOUND_S = 0.25


def _health_latencies(server, seconds: float) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        assert server.request("GET", "/health", key=None)[0] == 200
        out.append(time.monotonic() - start)
        time.sleep(0.02)
    return out


def test_a_20_mb_body_is_refused_at_once_and_health_answers(server):
    body = json.dumps({"model": MODEL, "prompt": "x " * 10_000_000}).encode()
    result = {}

    def send():
        sock = raw_post(server.url, "/v1/completions", body, API_KEY)
        result["answer"] = read_all(sock, 60)

    sender = threading.Thread(target=send)
    sender.start()
    latencies = _health_latencies(server, 2.0)
    sender.join(60)
    assert b" 413 " in result["answer"].split(b"\r\n")[0]
    assert b'"request_too_large"' in result["answer"]
    assert max(latencies) < HEALTH_BOUND_S, max(latencies)


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """4 MB of text (under the cap) takes seconds to tokenize; /health answers meanwhile."""
    body = {"model": MODEL, "prompt": "tokenize me please " * 220_000, "max_tokens": 1}
    result = {}

    def send():
        result["answer"] = server.request("POST", "/v1/completions", body)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)  # the body is read; tokenizing begins
    latencies = _health_latencies(server, 1.5)
    sender.join(120)
    status, err = result["answer"]
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < HEALTH_BOUND_S, max(latencies)


def test_a_full_queue_answers_429_and_the_others_are_served(open_server):
    s = open_server
    def post():
        return raw_post(s.url, "/v1/completions", {**LONG, "max_tokens": 40})

    socks = [post()]
    assert wait_for(lambda: metrics(s)["frugal_num_requests_running"] == 1, timeout=30)
    socks += [post(), post()]
    assert wait_for(lambda: metrics(s)["frugal_num_requests_waiting"] == 2, timeout=30)
    status, err = s.request("POST", "/v1/completions", {**LONG, "max_tokens": 2}, key=None)
    assert status == 429 and err["error"]["code"] == "rate_limit_exceeded", err
    answers = [read_all(sock, 120) for sock in socks]
    assert all(b" 200 " in a.split(b"\r\n")[0] for a in answers), answers
    status, _ = s.request("POST", "/v1/completions", {**LONG, "max_tokens": 2}, key=None)
    assert status == 200


def test_shutdown_past_its_timeout_ends_streams_with_an_error_event(tmp_path):
    s = start_server(tmp_path / "serve.log", "--kv-cache-memory", "64MiB",
                     "--shutdown-timeout", "1", "--log-level", "WARNING")
    sock = raw_post(s.url, "/v1/completions", {**LONG, "stream": True})
    assert wait_for(lambda: metrics(s)["frugal_generation_tokens_total"] > 0, timeout=30)
    s.process.send_signal(signal.SIGTERM)
    events = [line for line in read_all(sock, 60).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert "shutting down" in error["message"] and error["type"] == "server_error"
    assert s.process.wait(timeout=60) == 0


HANG = """
import sys, time
from frugal.engine.llm_engine import LLMEngine
from frugal.cli.main import main
LLMEngine.step = lambda self: time.sleep(3600)
sys.exit(main(sys.argv[1:]))
"""


def test_a_hung_step_marks_the_engine_dead_and_serve_exits_1(tmp_path):
    log = tmp_path / "serve.log"
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", HANG, "serve", "--port", str(port), "--kv-cache-memory",
             "64MiB", "--step-timeout", "2"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _status(url, "/health") == 200, timeout=120), log.read_text()
        start = time.monotonic()
        answer = read_all(raw_post(url, "/v1/completions", {**LONG, "max_tokens": 4}), 60)
        assert b" 503 " in answer.split(b"\r\n")[0] and b"has not returned" in answer
        assert time.monotonic() - start < 10
        assert process.wait(timeout=30) == 1
    finally:
        process.kill()
    assert "engine dead" in log.read_text()


def _status(url: str, path: str) -> int | None:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url + path, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_a_bad_port_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "frugal.cli.main", "serve", "--port", "99999"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "99999 is not a TCP port" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_port_in_use_fails_before_the_banner(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "frugal.cli.main", "serve", "--port",
                            str(port), "--kv-cache-memory", "64MiB"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "address already in use" in r.stderr.lower()
    assert "frugal: serving" not in r.stdout and "Traceback" not in r.stderr


def test_banner_and_log_level(server):
    log = server.output()
    assert '-H "Authorization: Bearer $FRUGAL_API_KEY"' in log  # the shell expands it
    assert "Uvicorn running" not in log  # --log-level WARNING reaches uvicorn
