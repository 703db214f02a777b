"""The test servers' own hygiene: a server that fails half way (its port taken: it loads, starts
a tensor-parallel rank, then cannot listen) is killed with every process it started, so a
fixture that fails leaves nothing behind."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

from tests.server.conftest import start_server


def session_members(sid: int) -> list[int]:
    """Live processes of session sid (a server leads its own: start_server)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # (field 6 of stat: the session)
            found.append(int(pid))
    return found


def test_a_server_that_never_becomes_healthy_leaves_no_process(tmp_path, monkeypatch):
    started, most = [], [0]
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def watch(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            if started:
                most[0] = max(most[0], len(session_members(started[0].pid)))

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr("tests.server.conftest.free_port", lambda: taken.getsockname()[1])
        monkeypatch.setattr("tests.server.conftest.subprocess.Popen", popen)
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        watcher.start()
        try:
            with pytest.raises(RuntimeError, match="did not become healthy"):
                start_server(tmp_path / "serve.log", "--tensor-parallel-size", "2",
                             "--dtype", "float32", "--kv-cache-memory", "64MiB", timeout=120)
        finally:
            stop.set()
            watcher.join()
    [server] = started
    assert server.returncode is not None and most[0] >= 2, most  # the rank had started
    assert session_members(server.pid) == []
