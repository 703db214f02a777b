"""Another process's memory mapped into this one, on one host: what a worker says of its KV pool
(`describe`) so that a peer maps it (`attach`), and whether that process still runs (`alive`).

A GPU tensor is shared through CUDA IPC (torch's handles of its allocation); a CPU tensor only
when it lives in a memory file (worker.kv_pool.host_shared_zeros: a memfd sealed against
resizing and against new writers), which a peer opens through /proc/<pid>/fd/<fd>, read-only.
A description is trusted no further than this: a peer maps memory only when the description
names this host (its boot id) and a process it sees that started when it says (not a later one
given the same pid), for a GPU tensor this worker's GPU (by UUID) and another process (CUDA IPC
does not open a process's own memory), and every field is of the type and range it must be; the
file it opens must be the one described (its inode), sealed, and large enough. Anything else is
Unmappable, with the reason.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import logging
import mmap
import os
import re
import warnings

import torch

from frugal.disagg.layout import meta_int

logger = logging.getLogger("frugal")

IPC_REF_COUNTERS = 10000  # int64 counters in one of torch's CUDA IPC reference-counter files
_REF_COUNTER_NAME = re.compile(r"/torch_[0-9]+_[0-9]+_[0-9]+")
_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t


class Unmappable(Exception):
    """A peer's memory this worker cannot map (the message says why)."""


@functools.cache
def host_id() -> str:
    """This host's boot id (the same in every container on the host)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _process(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process pid, None if none shows here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(desc: dict) -> bool:
    """Whether the process that described its memory still runs here: its pid, started when it
    said (not a later process given the same pid), and not a zombie."""
    pid = desc.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 32:
        return False
    found = _process(pid)
    return found is not None and found[0] not in "ZX" and found[1] == desc.get("started")


def _gpu(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def describe(memory: torch.Tensor, memfd: int | None) -> dict | None:
    """What a peer on this host needs to map `memory` (contiguous; a CPU tensor: the whole of
    the memory file memfd, from its start), or None when it cannot be shared (a CPU tensor
    without a memory file, an allocator without CUDA IPC)."""
    nbytes, me = memory.numel() * memory.element_size(), os.getpid()
    if memory.is_cuda:
        try:
            (_, handle, size, offset, counter, counter_offset, event,
             event_sync) = memory.untyped_storage()._share_cuda_()
        except RuntimeError as e:  # (cudaMallocAsync, a pluggable allocator)
            logger.info("the KV pool cannot be shared through CUDA IPC: %s", e)
            return None
        return {"kind": "cuda_ipc", "host": host_id(), "pid": me, "started": _process(me)[1],
                "gpu": _gpu(memory.device), "handle": _b64(handle), "storage_bytes": size,
                "offset_bytes": offset, "ref_counter": _b64(counter),
                "ref_counter_offset": counter_offset, "event": _b64(event),
                "event_sync": bool(event_sync),
                "start": memory.storage_offset() * memory.element_size(), "bytes": nbytes}
    if memfd is None:
        return None
    st = os.fstat(memfd)
    return {"kind": "memfd", "host": host_id(), "pid": me, "started": _process(me)[1],
            "fd": memfd, "inode": st.st_ino, "dev": st.st_dev, "bytes": nbytes}


def _int(desc: dict, name: str, high: int = 1 << 63) -> int:
    """layout.meta_int's check, failing as Unmappable (the peer stays on NIXL)."""
    try:
        return meta_int(desc, name, 0, high)
    except ValueError:
        raise Unmappable(f"its description's {name} is not an integer in [0, {high})") from None


def _bytes(desc: dict, name: str, sizes: range) -> bytes:
    value = desc.get(name)
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise Unmappable(f"its description's {name} is not base64") from None
    if len(raw) not in sizes:
        raise Unmappable(f"its description's {name} has {len(raw)} bytes")
    return raw


def attach(desc, nbytes: int, device: torch.device) -> torch.Tensor:
    """uint8 [nbytes]: the peer's memory `desc` (its describe()) names, mapped here, for a pool
    on `device` to read from. Raises Unmappable saying why not (whatever fails)."""
    if not isinstance(desc, dict) or desc.get("host") != host_id():
        raise Unmappable("it runs on another host")
    if not alive(desc):
        raise Unmappable("its process is not one this host shows (another PID namespace?) "
                         "or has ended")
    if _int(desc, "bytes") != nbytes:
        raise Unmappable(f"it describes {desc['bytes']} bytes where its pool takes {nbytes}")
    kind = desc.get("kind")
    try:
        if kind == "memfd" and device.type == "cpu":
            return _attach_memfd(desc, nbytes)
        if kind == "cuda_ipc" and device.type == "cuda":
            return _attach_cuda(desc, nbytes, device)
    except Unmappable:
        raise
    except Exception as e:  # (mmap, CUDA IPC: any failure keeps NIXL)
        raise Unmappable(f"mapping it failed ({type(e).__name__}: {e})") from None
    raise Unmappable(f"its pool ({kind}) and this one ({device.type}) are not on one device")


def _attach_memfd(desc: dict, nbytes: int) -> torch.Tensor:
    pid, fd = _int(desc, "pid", 1 << 32), _int(desc, "fd", 1 << 31)
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise Unmappable(f"its memory file does not open here ({e.strerror}; another PID "
                         "namespace?)") from None
    try:
        st = os.fstat(f)
        if (st.st_ino, st.st_dev) != (_int(desc, "inode"), _int(desc, "dev")):
            raise Unmappable("the file its description names here is not its memory file "
                             "(another PID namespace?)")
        sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
        if fcntl.fcntl(f, fcntl.F_GET_SEALS) & sealed != sealed:
            raise Unmappable("its memory file is not sealed against shrinking")
        if st.st_size < nbytes:
            raise Unmappable(f"its memory file holds {st.st_size} bytes, not {nbytes}")
        memory = mmap.mmap(f, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(f)
    with warnings.catch_warnings():  # (read-only: torch warns that it is not writable)
        warnings.simplefilter("ignore")
        return torch.frombuffer(memory, dtype=torch.uint8)


def _attach_cuda(desc: dict, nbytes: int, device: torch.device) -> torch.Tensor:
    if desc.get("gpu") != _gpu(device):
        raise Unmappable("its pool is on another GPU")
    if desc.get("pid") == os.getpid():
        raise Unmappable("it is this process (CUDA IPC maps another process's memory)")
    size, start = _int(desc, "storage_bytes"), _int(desc, "start")
    if start + nbytes > size or start % 16:
        raise Unmappable(f"its pool's {nbytes} bytes from {start} are not within its {size} "
                         "bytes, 16-byte aligned")
    counter = _bytes(desc, "ref_counter", range(1, 256))
    if not _REF_COUNTER_NAME.fullmatch(counter.decode("ascii", "replace")):
        raise Unmappable("its reference counter is not one of torch's CUDA IPC files")
    args = (device.index or 0, _bytes(desc, "handle", range(_IPC_HANDLE_BYTES, 1024)), size,
            _int(desc, "offset_bytes"), counter,
            _int(desc, "ref_counter_offset", IPC_REF_COUNTERS),
            _bytes(desc, "event", range(_IPC_HANDLE_BYTES, _IPC_HANDLE_BYTES + 1)),
            desc.get("event_sync") is True)
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,))
