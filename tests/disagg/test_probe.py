"""The route of a hand-off, found by a probe read at first contact (disagg.probe): UCX's logged
tables read back, the route judged, and over real NIXL with UCX held to TCP, a decode worker
that reports it, counts it, and with --kv-require-fast-path refuses it."""

import os
import subprocess
import sys
import textwrap

import pytest

from frugal.disagg import probe, ucx_log

PREFIX = "[1796450363.229667] [vm:7477 :0]   "


def table(agent: str, title: str, configs: list[str], ranges: list[str] | None = None) -> str:
    rows = [f"| {agent} intra-node cfg#1 |", f"| {title} |", "| Range | Description | Config |"]
    rows += [f"| {r} | zero-copy | {c} |" for r, c in zip(ranges or ["0..inf"] * len(configs),
                                                        configs, strict=True)]
    return "".join(PREFIX + r + "\n" + PREFIX + "+----+\n" for r in rows)


def test_the_read_tables_of_this_agent_name_the_transports(tmp_path):
    log = tmp_path / "ucx.log"
    read = "remote memory read by ucp_get*(multi) into host memory from host"
    log.write_text(table("decode", read, ["cma/memory"])
                   + table("decode", "remote memory write by ucp_put* from host", ["tcp/lo"])
                   + table("prefill", read, ["tcp/lo"]))
    assert ucx_log.read_tables(str(log), "decode") == [(0, {"cma"})]
    size = log.stat().st_size
    with log.open("a") as f:
        f.write(table("decode", read, ["cuda_copy/cuda, tcp/eth0",
                                       "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_2:1"]))
    assert ucx_log.transports(str(log), size, "decode") == {"cuda_copy", "tcp", "rc_mlx5"}
    # nothing logged since (UCX logs a configuration once): no transport named
    assert ucx_log.transports(str(log), log.stat().st_size, "decode") == set()
    assert ucx_log.transports(str(log), 0, "nobody") == set()
    # only the rows of messages of the probe's size count
    size = log.stat().st_size
    with log.open("a") as f:
        f.write(table("decode", read, ["tcp/lo", "cuda_ipc/cuda"], ["0..8240", "8241..inf"])
                + table("decode", read, ["cuda_copy/cuda"], ["0"]))
    assert ucx_log.transports(str(log), size, "decode") == {"cuda_ipc"}
    assert ucx_log.transports(None, 0, "decode") == set()


@pytest.mark.parametrize("transports, mem, gbps, kind, slow", [
    ({"tcp"}, "DRAM", 3.0, "TCP", True),
    ({"cuda_copy", "tcp"}, "VRAM", 0.5, "TCP", True),
    ({"cuda_copy", "rc_mlx5"}, "VRAM", 9.0, "a bounce through host memory", True),
    ({"cuda_ipc"}, "VRAM", 400.0, "CUDA IPC", False),
    ({"rc_mlx5"}, "VRAM", 40.0, "RDMA", False),
    ({"cma"}, "DRAM", 0.4, "shared memory", False),
    (set(), "VRAM", 2.0, "a transport UCX did not name", True),
    (set(), "VRAM", 200.0, "a transport UCX did not name", False),
])
def test_routes_are_judged_by_their_transports(transports, mem, gbps, kind, slow):
    route = probe.Route("e", "h:1", frozenset(transports), mem, gbps, True)
    assert (route.kind, route.slow) == (kind, slow)
    assert kind in route.describe() and "h:1" in route.describe()


def test_a_failed_or_damaged_probe_is_slow():
    assert probe.Route("e", "h:1", frozenset({"cuda_ipc"}), "VRAM", 0.0, False,
                       "no answer in 5 s").slow
    assert probe.Route("e", "h:1", frozenset({"cuda_ipc"}), "VRAM", 300.0, False).slow


SCRIPT = textwrap.dedent("""
    import logging, threading, time
    import pytest
    from frugal.disagg import SlowRoute
    from frugal.engine.llm_engine import LLMEngine
    from tests.disagg.engines import GREEDY, config, prefill

    logging.basicConfig(level=logging.INFO)

    p = LLMEngine(config(kv_role="prefill"))
    d = LLMEngine(config(kv_role="decode", kv_require_fast_path=True, kv_transport="nixl"))
    params = prefill(p, ["The capital of France is"])["p0"]
    stop = threading.Event()

    def serve():  # the prefill worker's loop, polling as it does while it holds pages
        while not stop.is_set():
            p.poll_transfers()
            time.sleep(0.001)

    t = threading.Thread(target=serve)
    t.start()
    try:
        for _ in range(2):  # probed once, refused each time
            with pytest.raises(SlowRoute, match="fast route .*kv-require-fast-path"):
                d.add_request("The capital of France is", GREEDY, "d0", params)
    finally:
        stop.set()
        t.join()
    assert d.stats().num_kv_slow_routes == 1
    assert not d.has_unfinished_requests() and d.scheduler.kv.num_free == d.worker.pool.num_pages
    print("refused")
    # the same prefill worker's pool mapped here: a fast route, the hand-off taken
    m = LLMEngine(config(kv_role="decode", kv_require_fast_path=True))
    m.add_request("The capital of France is", GREEDY, "m0", params)
    while m.has_unfinished_requests():
        m.step()
        p.poll_transfers()
    assert m.stats().num_kv_loads == m.stats().num_kv_mapped_loads == 1
    assert m.stats().num_kv_slow_routes == 0
    print("mapped")
""")


def test_a_tcp_route_is_reported_and_refused_with_require_fast_path():
    pytest.importorskip("nixl_cu13")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(UCX_TLS="tcp", FRUGAL_UCX_ERROR_HANDLING="none")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr[-3000:]
    assert "go over TCP (tcp), through NIXL" in done.stderr and "SLOW" in done.stderr
    assert "mapped" in done.stdout and "shared memory (memfd), its pool mapped" in done.stderr


def test_a_probe_that_cannot_read_fails_alone_and_the_next_one_works():
    """A peer's probe address outside what it registered (NIXL refuses the descriptors), and a
    peer of an earlier frugal without a probe: each a Route with its error, nothing raised, the
    prober free again; then a good probe reads the peer's bytes intact."""
    pytest.importorskip("nixl_cu13")
    import torch

    from frugal.disagg.nixl import NixlTransfer
    from frugal.worker.kv_pool import KVPool

    prefill = NixlTransfer(KVPool(2, 8, 16, 2, 32, torch.float32, "cpu"), "probe-prefill")
    decode = NixlTransfer(KVPool(2, 8, 16, 2, 32, torch.float32, "cpu"), "probe-decode")
    meta = prefill.metadata()
    decode.connect({**meta, "probe_addr": meta["probe_addr"] + (64 << 20)}, "far")
    decode.start_probe("probe-prefill", "far")
    route = decode.prober.result(5.0, wait=True)
    assert route.error and route.slow and not decode.prober.busy
    older = {k: v for k, v in meta.items() if not k.startswith("probe_")}
    decode.connect({**older, "engine_id": "older"}, "old")
    decode.start_probe("older", "old")
    route = decode.prober.result(5.0)
    assert "no probe" in route.error and not decode.prober.busy
    decode.prober.start("probe-prefill", "near", decode._remotes["probe-prefill"].name,
                        meta["probe_addr"], 0, "DRAM", meta["probe_sha256"])
    while (route := decode.prober.result(5.0)) is None:
        prefill.notifications()  # (the peer's progress, as its engine loop makes it)
    assert route.error is None and route.intact and route.gb_per_s > 0
