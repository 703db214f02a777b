"""The engine's side of prefill/decode disaggregation, in vLLM's kv_transfer_params protocol.

Prefill worker: a request with {"do_remote_decode": true} runs its prompt and samples one token
as usual; when it ends, its pages stay held (Scheduler.hold, key "lease:<request_id>") and its
output carries the kv_transfer_params a decode worker needs: the pages, a checksum of each
computed on the device, the first token. The pages are freed when the decode side's read
notifies its end, or when the lease runs out.

With the deployment's secret (disagg.signing) the prefill worker signs those params, expiring
with the lease, and a decode worker admits only params it can verify, once each: page ids,
host, checksums and prompt hash are the prefill worker's, never a client's, and its prefix
cache takes the loaded pages only under the tokens the prefill worker computed (the signed
prompt hash). Pages held for decode workers are capped (max_held_fraction of the pool); past it
a new prefill for a decode worker is refused (HeldPagesFull, a 503).

Decode worker: a request with {"do_remote_prefill": true, ...} (those params, plus "peer": the
prefill worker's NixlTransfer.metadata() that the server fetched from its side channel) waits in
the scheduler's loading state with fresh pages for its prompt, is filled by one NIXL read, has
each page's checksum compared with the prefill side's, and then runs from its prompt's end with
the prefill side's first token as its first output. A read that fails, times out or brings a
page whose checksum differs fails that request alone (the error says which page, never a
checksum). A read that has not ended after timeout_s is cancelled and its pages freed (held
until NIXL confirms the cancel). Leading pages the decode worker's own prefix cache holds are
not read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass

from frugal.disagg import HeldPagesFull, faults
from frugal.disagg.nixl import NixlTransfer
from frugal.disagg.signing import SIGNATURE, Rejected, Replays, Signer
from frugal.request import Request, TokenLogprob
from frugal.worker.kv_pool import KVPool

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


LOGPROB_FLOOR = -9999.0  # a non-finite log-probability as JSON carries it (as vLLM clamps)
MAX_TOP = 64


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def _bad(name: str, what: str) -> ValueError:
    return ValueError(f"kv_transfer_params: {name}: {what}")


def _field(params: dict, name: str, kind: type | tuple[type, ...]):
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _bad(name, f"expected {getattr(kind, '__name__', kind)}, got "
                         f"{type(value).__name__}")
    return value


def _int_list(params: dict, name: str, length: int, low: int, high: int) -> list[int]:
    value = _field(params, name, list)
    if len(value) != length or any(not isinstance(v, int) or isinstance(v, bool)
                                   or not low <= v < high for v in value):
        raise _bad(name, f"expected {length} integers in [{low}, {high}) (one per page of the "
                         "prompt)")
    return value


def _token(value, vocab_size: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise _bad(name, "not a token id")
    return value


def _logprob(value, name: str) -> float:
    """A log-probability as hold() writes it: its repr (a float is not carried exactly)."""
    try:
        number = float(value) if isinstance(value, str) and len(value) < 32 else math.nan
    except ValueError:
        number = math.nan
    if math.isnan(number) or number > 0:
        raise _bad(name, "not a log-probability")
    return number


def _first_logprob(value, vocab_size: int) -> TokenLogprob | None:
    """The prefill side's first-token log-probability as TokenLogprob; ValueError if malformed."""
    if value is None:
        return None
    name = "first_logprob"
    if not isinstance(value, dict) or not isinstance(value.get("top"), list) \
            or len(value["top"]) > MAX_TOP:
        raise _bad(name, "expected {token_id, logprob, top}")
    top = []
    for entry in value["top"]:
        if not isinstance(entry, list) or len(entry) != 2:
            raise _bad(name, "top: expected [token_id, logprob] pairs")
        top.append((_token(entry[0], vocab_size, name), _logprob(entry[1], name)))
    return TokenLogprob(_token(value.get("token_id"), vocab_size, name),
                        _logprob(value.get("logprob"), name), top)


def _text(x: float) -> str:
    """A log-probability as a signed field carries it (signing: no floats), finite."""
    return repr(float(x) if math.isfinite(x) else LOGPROB_FLOOR)


class Handoff:
    """Held prefill pages and loads in flight for one engine (engine thread only).

    config: the engine's EngineConfig (kv_role, kv_lease_s, kv_transfer_timeout_s, kv_secret,
    kv_address: the (host, port) decode workers reach this worker's side channel at,
    kv_max_held_fraction)."""

    def __init__(self, scheduler, pool: KVPool, engine_id: str, vocab_size: int,
                 config) -> None:
        self.scheduler, self.pool, self.vocab_size = scheduler, pool, vocab_size
        self.role = config.kv_role
        self.lease_s, self.timeout_s = config.kv_lease_s, config.kv_transfer_timeout_s
        self.address = config.kv_address
        self.max_held_pages = int(config.kv_max_held_fraction * pool.num_pages)
        self.signer = Signer(config.kv_secret)
        self.transfer = NixlTransfer(pool, engine_id)
        self.metadata = self.signer.sign(self.transfer.metadata())
        self.faults = faults.from_env()
        self._replays = Replays()
        self._pinning: dict[str, int] = {}  # prefills for decode workers: pages they will hold
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
        ValueError naming what is wrong (signing.Rejected for params this worker cannot
        verify), HeldPagesFull when the held pages are at their cap."""
        if params.get("do_remote_decode"):
            self._admit_prefill(request)
            return
        if self.role == "prefill":
            raise _bad("do_remote_prefill", "this worker is a prefill worker (--kv-role prefill)")
        peer = params.get("peer")
        if not isinstance(peer, dict):
            raise ValueError("kv_transfer_params: the prefill worker's metadata is missing")
        fields = self.signer.verify({k: v for k, v in params.items() if k != "peer"})
        num_pages = -(-request.num_prompt_tokens // self.pool.page_size)
        if fields.get("prompt_sha256") != prompt_hash(request.prompt_token_ids):
            raise _bad("prompt_sha256", "the prefill worker ran a different prompt (the two "
                                        "workers tokenize it differently?)")
        engine_id = _field(fields, "remote_engine_id", str)
        if engine_id != peer.get("engine_id"):
            raise _bad("remote_engine_id", "the prefill worker's side channel answers for "
                                           "another engine (restarted?)")
        where = f"{fields.get('remote_host')}:{fields.get('remote_port')}"
        self.transfer.connect(peer, where)  # ValueError when its layout differs from ours
        remote_pages = self.transfer.num_remote_pages(engine_id)
        load = KVLoad(engine_id, _field(fields, "remote_request_id", str),
                      _int_list(fields, "remote_block_ids", num_pages, 0, remote_pages),
                      _int_list(fields, "page_checksums", num_pages, -(1 << 63), 1 << 63),
                      _token(fields.get("first_token_id"), self.vocab_size, "first_token_id"),
                      _first_logprob(fields.get("first_logprob"), self.vocab_size), where)
        if not self._replays.first(params[SIGNATURE], fields.get("expires_at")):
            raise Rejected()
        request.kv_load = load

    def _admit_prefill(self, request: Request) -> None:
        if self.role == "decode":
            raise _bad("do_remote_decode", "this worker is a decode worker (--kv-role decode)")
        pages = -(-request.num_prompt_tokens // self.pool.page_size)
        held = sum(len(t) for k, (t, _) in self.scheduler.held.items() if k.startswith("lease:"))
        if held + sum(self._pinning.values()) + pages > self.max_held_pages:
            raise HeldPagesFull(
                f"kv_transfer_params: this prefill worker holds its share of KV pages for "
                f"decode workers ({self.max_held_pages} of {self.pool.num_pages}, "
                f"--kv-max-held-fraction); retry later or elsewhere")
        request.kv_hold = True
        self._pinning[request.request_id] = pages
        # its one token stands for the decode side's first: sampled as there without
        # min_tokens (vllm-router sets 1 here; the decode side applies the client's)
        request.params = dataclasses.replace(request.params, min_tokens=0)
        request.max_total_tokens = min(request.max_total_tokens, request.num_prompt_tokens + 1)

    # -- prefill side -----------------------------------------------------------------------

    def hold(self, request: Request) -> tuple[dict, tuple[str, float]]:
        """A finished prefill's kv_transfer_params, signed, and the hold for Scheduler.finish."""
        self._pinning.pop(request.request_id, None)
        pages = list(request.page_table.ids)
        logprob = request.logprobs[0] if request.logprobs else None
        host, port = self.address if self.address is not None else (None, None)
        params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.transfer.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": pages,
            "remote_host": host, "remote_port": port,
            "tp_size": 1, "page_checksums": self.pool.checksums(pages),
            "first_token_id": request.output_token_ids[0],
            "first_logprob": None if logprob is None else {
                "token_id": logprob.token_id, "logprob": _text(logprob.logprob),
                "top": [[t, _text(v)] for t, v in logprob.top]},
            "prompt_sha256": prompt_hash(request.prompt_token_ids),
        }
        return (self.signer.sign(params, ttl_s=self.lease_s),
                ("lease:" + request.request_id, self.lease_s))

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
                logger.warning("KV transfer from %s failed to start: %s", load.where, e)
                self._fail(request, f"KV transfer from {load.where} failed to start")

    def ended(self, request: Request) -> tuple[str, float] | None:
        """The request ends (abort, error) before its KV came: the hold for Scheduler.finish
        when its read may still write its pages, else None. The prefill side is told to free
        its pages either way."""
        self._pinning.pop(request.request_id, None)
        load = request.kv_load
        if load is None:
            return None
        self.transfer.notify(load.engine_id, load.remote_request_id.encode())
        if request.request_id in self._loads:
            self._abandoned.add(request.request_id)
            return "load:" + request.request_id, float("inf")  # until the read ends or cancels
        return None

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose KV arrived intact (to run from their prompt's end), and those that
        failed with why. Frees the pages of expired leases, of reads the decode side announced
        done, and of reads given up after timeout_s."""
        for message in self.transfer.notifications():
            self.scheduler.release("lease:" + message.decode(errors="replace"))
        for key in self.scheduler.expired():
            self.num_leases_expired += 1
            logger.warning("KV pages held for %s freed unread after %.0f s", key, self.lease_s)
            self.scheduler.release(key)
        loaded = []
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
        for request_id, request in list(self._loads.items()):
            age = self.transfer.in_flight(request_id)
            if age is None or age <= self.timeout_s:
                continue
            if self.transfer.cancel(request_id):  # it can no longer write our pages
                del self._loads[request_id]
                if request_id in self._abandoned:
                    self._abandoned.discard(request_id)
                    self.scheduler.release("load:" + request_id)
                    continue
            elif request_id in self._abandoned:
                continue  # already failed; its pages stay held until the cancel succeeds
            self._fail(request, f"KV transfer from {request.kv_load.where} has not finished "
                                f"in {self.timeout_s:g} s")
        failed, self._failed = self._failed, []
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
                        "arrived damaged (its checksum differs from the prefill worker's)")
        return None

    def _fail(self, request: Request, error: str) -> None:
        self.num_load_failures += 1
        self._failed.append((request, error))

    @property
    def busy(self) -> bool:
        return bool(self._loads)
