"""The engine's side of prefill/decode disaggregation, in vLLM's kv_transfer_params protocol.

Prefill worker: a request with {"do_remote_decode": true} runs its prompt and samples one token
as usual; when it ends, its pages stay held (Scheduler.hold, key "lease:<request_id>") and its
output carries the kv_transfer_params a decode worker needs: the pages, a checksum of each
computed on the device, the first token. The pages are freed when the decode side's read
notifies its end, or when the lease runs out.

Decode worker: a request with {"do_remote_prefill": true, ...} (those params, plus "peer": the
prefill worker's NixlTransfer.metadata() that the server fetched from its side channel) waits in
the scheduler's loading state with fresh pages for its prompt, is filled by one NIXL read, has
each page's checksum compared with the prefill side's, and then runs from its prompt's end with
the prefill side's first token as its first output. A read that fails, times out or brings a
page whose checksum differs fails that request alone. Leading pages the decode worker's own
prefix cache holds are not read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass

from frugal.disagg import faults
from frugal.disagg.kv_transfer import NixlTransfer
from frugal.kv_cache.pool import KVPool
from frugal.request import Request, TokenLogprob

logger = logging.getLogger("frugal")


@dataclass
class KVLoad:
    """Where a decode request's prompt KV is (parsed from kv_transfer_params)."""

    engine_id: str
    remote_request_id: str
    remote_pages: list[int]
    checksums: list[int]
    first_token: int
    first_logprob: TokenLogprob | None
    where: str
    first_page: int = 0  # pages before this one came from the decode side's prefix cache


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _field(params: dict, name: str, kind: type | tuple[type, ...]):
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"kv_transfer_params: {name}: expected {getattr(kind, '__name__', kind)}"
                         f", got {value!r}")
    return value


def _int_list(params: dict, name: str, length: int) -> list[int]:
    value = _field(params, name, list)
    if len(value) != length or any(not isinstance(v, int) or isinstance(v, bool)
                                   for v in value):
        raise ValueError(f"kv_transfer_params: {name}: expected {length} integers (one per page "
                         f"of the prompt), got {value!r:.200}")
    return value


class Handoff:
    """Held prefill pages and loads in flight for one engine (engine thread only)."""

    def __init__(self, scheduler, pool: KVPool, engine_id: str, vocab_size: int,
                 lease_s: float = 120.0, timeout_s: float = 30.0) -> None:
        self.scheduler, self.pool, self.vocab_size = scheduler, pool, vocab_size
        self.lease_s, self.timeout_s = lease_s, timeout_s
        self.transfer = NixlTransfer(pool, engine_id)
        self.metadata = self.transfer.metadata()
        self.faults = faults.from_env()
        self._loads: dict[str, Request] = {}  # request_id -> request whose read is in flight
        self._abandoned: set[str] = set()  # loads whose request ended while its read ran
        self._failed: list[tuple[Request, str]] = []
        self.num_loads = 0
        self.num_load_failures = 0  # reads that failed, timed out or brought a bad checksum
        self.num_leases_expired = 0
        self.bytes_loaded = 0

    # -- admission --------------------------------------------------------------------------

    def admit(self, request: Request, params: dict) -> None:
        """Bind a new request to kv_transfer_params that want a transfer (wants_transfer);
        ValueError naming what is wrong."""
        if params.get("do_remote_decode"):
            request.kv_hold = True
            # its one token stands for the decode side's first: sampled as there without
            # min_tokens (vllm-router sets 1 here; the decode side applies the client's)
            request.params = dataclasses.replace(request.params, min_tokens=0)
            request.max_total_tokens = min(request.max_total_tokens,
                                           request.num_prompt_tokens + 1)
            return
        peer = params.get("peer")
        if not isinstance(peer, dict):
            raise ValueError("kv_transfer_params: the prefill worker's metadata is missing")
        where = f"{params.get('remote_host')}:{params.get('remote_port')}"
        num_pages = -(-request.num_prompt_tokens // self.pool.page_size)
        if params.get("prompt_sha256") != prompt_hash(request.prompt_token_ids):
            raise ValueError("kv_transfer_params: prompt_sha256: the prefill worker ran a "
                             "different prompt (the two workers tokenize it differently?)")
        first = _field(params, "first_token_id", int)
        if not 0 <= first < self.vocab_size:
            raise ValueError(f"kv_transfer_params: first_token_id: {first} is not a token id")
        logprob = params.get("first_logprob")
        if logprob is not None:
            logprob = TokenLogprob(int(logprob["token_id"]), float(logprob["logprob"]),
                                   [(int(t), float(v)) for t, v in logprob["top"]])
        load = KVLoad(_field(params, "remote_engine_id", str),
                      _field(params, "remote_request_id", str),
                      _int_list(params, "remote_block_ids", num_pages),
                      _int_list(params, "page_checksums", num_pages), first, logprob, where)
        if load.engine_id != peer.get("engine_id"):
            raise ValueError(f"kv_transfer_params: remote_engine_id: {load.engine_id!r}, but the "
                             f"worker at {where} is {peer.get('engine_id')!r} (restarted?)")
        self.transfer.connect(peer, where)  # ValueError when its layout differs from ours
        request.kv_load = load

    # -- prefill side -----------------------------------------------------------------------

    def hold(self, request: Request) -> tuple[dict, tuple[str, float]]:
        """A finished prefill's kv_transfer_params (what the prefill worker's server adds:
        remote_host, remote_port) and the hold for Scheduler.finish."""
        pages = list(request.page_table.ids)
        logprob = request.logprobs[0] if request.logprobs else None
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.transfer.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": pages,
            "tp_size": 1, "page_checksums": self.pool.checksums(pages),
            "first_token_id": request.output_token_ids[0],
            "first_logprob": None if logprob is None else {
                "token_id": logprob.token_id, "logprob": logprob.logprob,
                "top": [list(t) for t in logprob.top]},
            "prompt_sha256": prompt_hash(request.prompt_token_ids),
        }
        return params, ("lease:" + request.request_id, self.lease_s)

    # -- decode side ------------------------------------------------------------------------

    def start(self, requests: list[Request]) -> None:
        """Start the reads of requests the scheduler just admitted to loading."""
        for request in requests:
            load: KVLoad = request.kv_load
            load.first_page = request.num_computed_tokens // self.pool.page_size
            try:
                self.transfer.read(request.request_id, list(request.page_table.ids)[
                                   load.first_page:], load.engine_id,
                                   load.remote_pages[load.first_page:],
                                   load.remote_request_id.encode())
                self._loads[request.request_id] = request
            except Exception as e:
                self._fail(request, f"KV transfer from {load.where} failed to start: {e}")

    def ended(self, request: Request) -> tuple[str, float] | None:
        """The request ends (abort, error) before its KV came: the hold for Scheduler.finish
        when its read may still write its pages, else None. The prefill side is told to free
        its pages either way."""
        load = request.kv_load
        if load is None:
            return None
        self.transfer.notify(load.engine_id, load.remote_request_id.encode())
        if request.request_id in self._loads:
            self._abandoned.add(request.request_id)
            return "load:" + request.request_id, float("inf")
        return None

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose KV arrived intact (to run from their prompt's end), and those that
        failed with why. Frees the pages of expired leases and of reads the decode side
        announced done."""
        for message in self.transfer.notifications():
            self.scheduler.release("lease:" + message.decode(errors="replace"))
        for key in self.scheduler.expired():
            self.num_leases_expired += 1
            logger.warning("KV pages held for %s freed unread after %.0f s", key, self.lease_s)
            self.scheduler.release(key)
        loaded, failed, self._failed = [], self._failed, []
        for request_id, error in self.transfer.done(self.faults.read_delay_s):
            request = self._loads.pop(request_id)
            if request_id in self._abandoned:
                self._abandoned.discard(request_id)
                self.scheduler.release("load:" + request_id)
                continue
            error = error or self._verify(request)
            if error is None:
                self.num_loads += 1
                loaded.append(request)
            else:
                self._fail(request, error)
        for request_id, request in self._loads.items():
            age = self.transfer.in_flight(request_id)
            if age is not None and age > self.timeout_s and request_id not in self._abandoned:
                self._fail(request, f"KV transfer from {request.kv_load.where} has not finished "
                                    f"in {self.timeout_s:g} s")
        failed, self._failed = failed + self._failed, []
        return loaded, failed

    def _verify(self, request: Request) -> str | None:
        first = request.kv_load.first_page
        pages = list(request.page_table.ids)[first:]
        self.faults.after_read(self.pool, pages)
        sums = self.pool.checksums(pages)
        self.bytes_loaded += len(pages) * (self.pool.num_bytes // self.pool.num_pages)
        for i, (got, want) in enumerate(zip(sums, request.kv_load.checksums[first:]), first):
            if got != want:
                return (f"KV transfer from {request.kv_load.where}: page {i} of the prompt "
                        f"arrived with checksum {got:#x}, the prefill worker sent {want:#x}")
        return None

    def _fail(self, request: Request, error: str) -> None:
        self.num_load_failures += 1
        self._failed.append((request, error))

    @property
    def busy(self) -> bool:
        return bool(self._loads)
