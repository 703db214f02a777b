"""A tensor-parallel group lives and dies as one (Gloo, two processes on the CPU): when rank 1's
process is SIGKILLed the engine dies at once (in a step: the failed collective is fatal; idle:
the watchdog sees the exit, with no step_timeout set) and `frugal serve` exits 1 with every rank
joined; a rank that hangs (SIGSTOP) is the step timeout's, with the same ending; when rank 0 is
SIGKILLed rank 1 exits on its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

from frugal import LLM, SamplingParams
from frugal.engine.async_engine import AsyncEngine, EngineDeadError
from tests.server.conftest import MODEL, Server, free_port, wait_for

FLAGS = ("--tensor-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "64MiB",
         "--log-level", "WARNING")


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (any of its threads')."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += map(int, f.read().split())
    return found


def running(pid: int) -> bool:
    """pid names a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def is_rank(pid: int) -> bool:
    """(not the resource tracker, the server's other child)"""
    with open(f"/proc/{pid}/cmdline") as f:
        return "spawn_main" in f.read()


@contextmanager
def serving(log: Path, *flags: str):
    """`frugal serve` with tensor parallelism 2, in a session of its own: (the server, the pids
    of its children once healthy). On the way out the whole process group is killed, whatever
    happened, so that nothing outlives the test."""
    port = free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "frugal.cli.main", "serve", "--port", str(port), *FLAGS, *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    s = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.time() + 120
        while not _healthy(s):
            assert process.poll() is None, f"server exited: {s.output()}"
            assert time.time() < deadline, f"server did not become healthy: {s.output()}"
            time.sleep(0.5)
        group = children(process.pid)
        assert sum(map(is_rank, group)) == 1, group
        yield s, group
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(30)


def _healthy(s: Server) -> bool:
    try:
        return s.request("GET", "/health")[0] == 200
    except OSError:
        return False


def status_or_refused(s: Server, method: str, path: str, body: dict | None = None):
    """The status, or "refused" once the server has stopped listening (it is exiting)."""
    try:
        return s.request(method, path, body)[0]
    except urllib.error.URLError as e:
        assert isinstance(e.reason, ConnectionRefusedError), e
        return "refused"


def kill_rank_in_a_step(s: Server, group: list[int], sig: int) -> tuple[str, float]:
    """Send rank 1 sig while a stream runs: (the rest of the stream, when sig was sent)."""
    [rank] = filter(is_rank, group)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(s.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.readline().startswith(b"data: {")  # tokens are coming
        os.kill(rank, sig)
        return resp.read().decode(), time.monotonic()


def assert_exits_1_leaving_nothing(s: Server, group: list[int]) -> None:
    assert s.process.wait(timeout=30) == 1, s.output()
    # rank 1 joined, and the resource tracker gone (it exits once its last user has)
    assert wait_for(lambda: not any(map(running, group)), 5), s.output()
    assert "Application shutdown failed" not in s.output()


def test_a_rank_killed_in_a_step_takes_the_server_down(tmp_path):
    with serving(tmp_path / "serve.log") as (s, group):
        rest, killed = kill_rank_in_a_step(s, group, signal.SIGKILL)
        # the waiting client is answered at once, as the engine's death (not a per-step 500)
        assert time.monotonic() - killed < 5 and "engine dead" in rest, rest
        assert "tensor-parallel rank 1" in rest and rest.rstrip().endswith("data: [DONE]")
        # /health answers 503 (for serve.DEAD_GRACE_S), then the server exits
        assert wait_for(lambda: status_or_refused(s, "GET", "/health") == 503,
                        5 - (time.monotonic() - killed))
        start = time.monotonic()
        assert status_or_refused(s, "POST", "/v1/completions",
                                 {"model": MODEL, "prompt": "Hi", "max_tokens": 4}) == 503
        assert time.monotonic() - start < 5
        assert_exits_1_leaving_nothing(s, group)
        assert "engine dead: tensor-parallel rank 1" in s.output()


def test_a_hung_rank_is_the_step_timeouts_and_takes_the_server_down(tmp_path):
    with serving(tmp_path / "serve.log", "--step-timeout", "4") as (s, group):
        rest, stopped = kill_rank_in_a_step(s, group, signal.SIGSTOP)
        assert time.monotonic() - stopped < 10 and "engine dead: a step has not" in rest, rest
        assert_exits_1_leaving_nothing(s, group)  # (the stopped rank killed, not waited for)


def test_ranks_exit_when_rank_0_is_killed(tmp_path):
    with serving(tmp_path / "serve.log") as (s, group):
        s.process.kill()
        s.process.wait(10)
        assert wait_for(lambda: not any(map(running, group)), 5), s.output()


def test_a_blocked_rank_exits_when_rank_0_is_gone():
    """(worker.exit_with_parent on its own) A rank whose main thread never returns, as in a
    collective on a dead peer that waits for its timeout (NCCL), still exits."""
    rank = ("import os, time; from frugal.worker.ranks import exit_with_parent; "
            "exit_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(120)")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; "
         f"subprocess.run([sys.executable, '-c', {rank!r}], timeout=120)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())  # ('' if the rank failed: its parent exits)
        assert running(child)
        parent.kill()
        parent.wait(10)
        assert wait_for(lambda: not running(child), 5)
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.stdout.close()


async def _generate(engine: AsyncEngine, request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    return [t async for out in engine.generate([1, 2, 3], params, request_id)
            for t in out.outputs[0].token_ids]


def test_the_idle_engine_dies_with_a_rank_and_leaves_nothing():
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory="16MiB", tensor_parallel_size=2)
    workers = list(llm.engine._ranks)
    reasons = []
    engine = AsyncEngine(llm.engine, on_dead=reasons.append)  # (no step_timeout)
    engine.start()
    try:
        assert len(asyncio.run(asyncio.wait_for(_generate(engine, "a"), 60))) == 4
        workers[0].kill()
        assert wait_for(lambda: not engine.alive, 5)  # what /health answers 503 on
        assert "tensor-parallel rank 1" in engine.dead and reasons == [engine.dead]
        with pytest.raises(EngineDeadError, match="rank 1"):
            asyncio.run(asyncio.wait_for(_generate(engine, "b"), 5))
    finally:
        engine.shutdown()
        for w in workers:  # (whatever shutdown did: nothing outlives the test)
            if w.is_alive():
                w.kill()
    assert not any(w.is_alive() for w in workers)
    assert not dist.is_initialized()  # (the next tensor-parallel engine here can start)
