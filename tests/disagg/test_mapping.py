"""Another process's KV pool mapped into this one (disagg.mapping): read-only, sealed, refused for
memory that is not the one described or for a process that ended, every field of a description
checked before anything is mapped."""

import fcntl
import mmap
import os
import subprocess
import sys
import time

import pytest
import torch

from frugal.disagg import mapping
from frugal.worker.kv_pool import KVPool
from tests.disagg.pools import CPU, SHAPE, start_peer


def test_a_mapping_reads_the_other_process_and_is_read_only(pool_peer):
    """The mapped bytes are the other process's pages; a store into the mapping is a fault of
    the process that tries it; the memory file opens for reading only (sealed)."""
    desc, sums = pool_peer
    nbytes = KVPool(*SHAPE).num_bytes
    memory = mapping.attach(desc, nbytes, CPU)
    pages = memory.view(SHAPE[0], 2, SHAPE[1], -1)
    mine = KVPool(*SHAPE)
    mine.storage.view(torch.uint8).view(SHAPE[0], 2, SHAPE[1], -1).copy_(pages)
    assert mine.checksums(list(range(12))) == sums
    code = ("import torch; from frugal.disagg import mapping; "
            f"m = mapping.attach({desc!r}, {nbytes}, torch.device('cpu')); m[:64].fill_(7)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert run.returncode < 0, run.stderr.decode()[-2000:]  # SIGSEGV or SIGBUS
    assert mine.checksums([0]) == sums[:1]
    path = f"/proc/{desc['pid']}/fd/{desc['fd']}"
    f = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    seals = fcntl.fcntl(f, fcntl.F_GET_SEALS)
    os.close(f)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    if seals & 0x10:  # F_SEAL_FUTURE_WRITE (Linux 5.1): no writes nor writable maps but its own
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            with pytest.raises(PermissionError):
                os.write(f, b"x")
            with pytest.raises(PermissionError):
                mmap.mmap(f, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(f)


def test_memory_that_is_not_the_one_described_is_refused(pool_peer, tmp_path):
    desc, _ = pool_peer
    nbytes = KVPool(*SHAPE).num_bytes
    other = tmp_path / "other"
    other.write_bytes(b"\0" * nbytes)
    fd = os.open(other, os.O_RDONLY)
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, nbytes)
    me = {"pid": os.getpid(), "started": mapping._process(os.getpid())[1]}
    try:
        cases = [
            ({**desc, "host": "another-host"}, "another host"),
            ({**desc, "bytes": nbytes + 1}, "describes"),
            ({**desc, **me, "fd": fd}, "not its memory file"),  # a file of the right size
            ({**desc, **me, "fd": unsealed,
              "inode": os.fstat(unsealed).st_ino}, "not sealed"),
            ({**desc, "fd": 1 << 20}, "does not open"),
            ({**desc, "pid": 1 << 30}, "not one this host shows"),
            ({**desc, "started": desc["started"] + 1}, "has ended"),  # its pid, given again
            ({**desc, "fd": "3"}, "not an integer"),
            ({**desc, "inode": True}, "not an integer"),
            ({**desc, "kind": "cuda_ipc"}, "not on one device"),
            ("a string", "another host"),
        ]
        for bad, why in cases:
            with pytest.raises(mapping.Unmappable, match=why):
                mapping.attach(bad, nbytes, CPU)
    finally:
        os.close(fd)
        os.close(unsealed)
    with pytest.raises(mapping.Unmappable, match="not on one device"):
        mapping.attach(desc, nbytes, torch.device("cuda", 0))
    small = KVPool(*SHAPE[:1], 4, *SHAPE[2:], shareable=True)  # a file too short for its claim
    with pytest.raises(mapping.Unmappable, match="holds"):
        mapping.attach({**mapping.describe(small.storage, small.memfd), "bytes": nbytes},
                       nbytes, CPU)


def test_cuda_descriptions_are_checked_before_cuda_sees_them(pool_peer, monkeypatch):
    """Every field torch's CUDA IPC would act on (a reference counter it writes into, handle
    lengths it trusts, offsets) is checked first; what CUDA itself refuses keeps NIXL too."""
    desc, _ = pool_peer
    monkeypatch.setattr(mapping, "_gpu", lambda device: "GPU-0")
    b64 = mapping._b64
    good = {"kind": "cuda_ipc", "host": desc["host"], "pid": desc["pid"],
            "started": desc["started"], "gpu": "GPU-0", "handle": b64(b"h" * 64),
            "storage_bytes": 1 << 20, "offset_bytes": 0, "ref_counter": b64(b"/torch_1_2_3"),
            "ref_counter_offset": 7, "event": b64(b"e" * 64), "event_sync": True,
            "start": 4096, "bytes": 4096}
    gpu = torch.device("cuda", 0)
    cases = [({**good, "gpu": "GPU-1"}, "another GPU"),
             ({**good, "pid": os.getpid(),
               "started": mapping._process(os.getpid())[1]}, "this process"),
             ({**good, "start": 1 << 20}, "not within"),
             ({**good, "start": 4100}, "16-byte aligned"),
             ({**good, "ref_counter_offset": mapping.IPC_REF_COUNTERS}, "not an integer"),
             ({**good, "ref_counter": b64(b"/dev/shm/other")}, "not one of torch's"),
             ({**good, "ref_counter": None}, "not base64"),
             ({**good, "handle": b64(b"h" * 10)}, "handle has 10 bytes"),
             ({**good, "event": b64(b"e" * 65)}, "event has 65 bytes"),
             ({**good, "handle": "%%%"}, "not base64"),
             (good, "mapping it failed")]  # (no CUDA here: torch raises)
    for bad, why in cases:
        with pytest.raises(mapping.Unmappable, match=why):
            mapping.attach(bad, 4096, gpu)


def test_a_process_that_ended_or_is_a_zombie_is_not_alive():
    child, pipe, desc, _ = start_peer()
    assert mapping.alive(desc) and not mapping.alive({**desc, "pid": True})
    child.kill()
    deadline = time.monotonic() + 10
    while (mapping._process(child.pid) or ("",))[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # killed, not yet reaped: a zombie
    assert not mapping.alive(desc)
    child.join(10)
    assert not mapping.alive(desc)
    with pytest.raises(mapping.Unmappable, match="has ended"):
        mapping.attach(desc, KVPool(*SHAPE).num_bytes, CPU)


def test_a_pool_without_a_memory_file_is_not_described():
    pool = KVPool(*SHAPE)
    assert pool.memfd is None and mapping.describe(pool.storage, None) is None
