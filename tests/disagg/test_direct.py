"""Hand-offs between workers on one host through the prefill worker's pool mapped into the decode
worker (disagg.direct): page copies from another process, their ends and failures, and NIXL for
a peer whose pool does not map."""

import multiprocessing as mp
import time

import pytest
import torch

from frugal.disagg import direct, mapping
from frugal.worker.kv_pool import KVPool
from tests.disagg.pools import CPU, SHAPE


def test_pages_copied_from_another_process_arrive_whole(pool_peer):
    desc, sums = pool_peer
    pool = KVPool(*SHAPE)
    remote = mapping.attach(desc, pool.num_bytes, CPU)
    copies, ended = direct.Copies(pool), []
    copies.start("a", [7, 0, 3], remote, [2, 11, 5], lambda: ended.append("a"))
    assert copies.done(min_age=60.0) == [] and copies.in_flight("a") is not None
    assert ended == []  # (then() runs when done() finds the copy ended)
    deadline = time.monotonic() + 10
    while not (done := copies.done()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done == [("a", None)] and ended == ["a"] and "a" not in copies
    assert pool.checksums([7, 0, 3]) == [sums[2], sums[11], sums[5]]
    assert pool.checksums([1, 2]) == KVPool(*SHAPE).checksums([1, 2])  # nothing else written
    assert copies.cancel("a") and copies.in_flight("a") is None


def test_a_cancelled_or_failed_copy_does_not_release_the_peer(pool_peer):
    """Only a copy that ended well runs then() (the peer is told to free its pages); the
    connector tells it for the others, as for a NIXL read."""
    desc, _ = pool_peer
    pool = KVPool(*SHAPE)
    remote = mapping.attach(desc, pool.num_bytes, CPU)
    copies, ended = direct.Copies(pool), []
    copies.start("b", [1], remote, [1], lambda: ended.append("b"))
    assert copies.cancel("b") and "b" not in copies and copies.done() == [] and ended == []
    copies.start("c", [1], remote, [12], lambda: ended.append("c"))  # past the peer's pages
    done = copies.done()
    assert done[0][0] == "c" and "the page copy failed" in done[0][1] and ended == []
    with pytest.raises(ValueError, match="2 pages here, 1 there"):
        copies.start("d", [1, 2], remote, [1], lambda: None)


def test_a_peer_that_does_not_map_is_read_over_nixl():
    """A prefill worker whose description does not map here (another host, as seen from this
    one) is read through NIXL, with the same pages and notification; one that maps is copied,
    and a copy that ended well sends the notification a NIXL read's end would."""
    pytest.importorskip("nixl_cu13")
    from frugal.disagg.nixl import NixlTransfer
    shape = (2, 8, 16, 2, 32, torch.float32, "cpu")
    near, far = KVPool(*shape, shareable=True), KVPool(*shape, shareable=True)
    far.storage.view(torch.uint8).random_()
    here, there = NixlTransfer(near, "direct-decode"), NixlTransfer(far, "direct-prefill")
    meta = there.metadata()
    moved = {**meta, "mapped": {k: {**v, "host": "elsewhere"} for k, v in
                                meta["mapped"].items()}}
    here.connect(moved, "far:1")
    assert not here.maps("direct-prefill")
    here.start_probe("direct-prefill", "far:1")
    while (route := here.prober.result(10.0)) is None:
        there.notifications()
    assert not route.mapped and "through NIXL" in route.describe()
    mapped = NixlTransfer(KVPool(*shape, shareable=True), "direct-prefill-2")
    mapped.pool.storage.view(torch.uint8).random_()
    here.connect(mapped.metadata(), "near:1")
    assert here.maps("direct-prefill-2")
    here.start_probe("direct-prefill-2", "near:1")
    route = here.prober.result(10.0, wait=True)
    assert route.mapped and route.transports == {"memfd"} and route.intact and not route.slow
    here.read("k", [3, 4], "direct-prefill", [6, 1], b"released")
    here.read("k2", [0], "direct-prefill-2", [5], b"released-2")
    deadline, got, notes = time.monotonic() + 10, [], []
    while time.monotonic() < deadline and not (len(got) == 2 and len(notes) == 2):
        got += here.done()
        here.notifications()  # (progress: a notification leaves as the engine's polls go on)
        notes += there.notifications() + mapped.notifications()
    assert sorted(got) == [("k", None), ("k2", None)]
    assert sorted(notes) == [b"released", b"released-2"]
    assert near.checksums([3, 4]) == far.checksums([6, 1])
    assert near.checksums([0]) == mapped.pool.checksums([5])


def test_the_transport_is_auto_or_nixl():
    from frugal.config import EngineConfig
    assert EngineConfig().kv_transport == "auto"
    assert EngineConfig(kv_transport="nixl").kv_transport == "nixl"
    with pytest.raises(ValueError, match="kv_transport: unsupported 'rdma'"):
        EngineConfig(kv_transport="rdma")


def _serve_cuda_pool(pipe) -> None:
    pool = KVPool(*SHAPE[:-1], "cuda")
    pool.storage.view(torch.uint8).random_()
    torch.cuda.synchronize()
    pipe.send((mapping.describe(pool.storage, None), pool.checksums(list(range(12)))))
    pipe.recv()


@pytest.mark.gpu
def test_cuda_ipc_pages_from_another_process():
    """A GPU pool of another process mapped through CUDA IPC and read by the Triton page copy
    on its own stream, queued after the work in flight without the host waiting for it (nor
    for a kernel load: compiled when Copies was made); the same process's own pool is refused
    (CUDA IPC cannot open it)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_serve_cuda_pool, args=(there,), daemon=True)
    child.start()
    try:
        desc, sums = here.recv()
        pool = KVPool(*SHAPE[:-1], "cuda")
        remote = mapping.attach(desc, pool.num_bytes, pool.storage.device)
        copies = direct.Copies(pool)
        torch.cuda._sleep(2_000_000_000)  # (~1 s of a step in flight on the current stream)
        began = time.monotonic()
        copies.start("g", [9, 4, 0, 1], remote, [0, 11, 3, 4], lambda: None)
        assert time.monotonic() - began < 0.2  # (queued after it, not waited for on the host)
        assert copies.done() == []
        while not copies.done():
            time.sleep(0.0005)
        assert pool.checksums([9, 4, 0, 1]) == [sums[0], sums[11], sums[3], sums[4]]
        own = mapping.describe(pool.storage, None)
        with pytest.raises(mapping.Unmappable, match="this process"):
            mapping.attach(own, pool.num_bytes, pool.storage.device)
    finally:
        here.send("done")
        child.join(10)


@pytest.mark.gpu
def test_a_gpu_pool_whose_process_died_reads_without_a_fault():
    """The prefill process killed after its pool was mapped: the decode process keeps running
    (a copy from the mapping neither faults nor hangs), and the liveness check says it ended."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_serve_cuda_pool, args=(there,), daemon=True)
    child.start()
    desc, sums = here.recv()
    pool = KVPool(*SHAPE[:-1], "cuda")
    remote = mapping.attach(desc, pool.num_bytes, pool.storage.device)
    child.kill()
    child.join(10)
    assert not mapping.alive(desc)
    copies = direct.Copies(pool)
    copies.start("dead", [0, 1], remote, [2, 3], lambda: None)
    deadline = time.monotonic() + 10
    while not (done := copies.done()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done == [("dead", None)]
    torch.cuda.synchronize()
    pool.checksums([0, 1])  # (whatever the bytes: the process and its context are intact)
