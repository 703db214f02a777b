"""A KV connector over NIXL (prefill/decode disaggregation, vLLM's kv_transfer_params protocol).

Prefill worker: a request with {"do_remote_decode": true} runs its prompt and samples one token
as usual; when it ends, its pages stay held (KVCacheManager.hold, key "lease:<request_id>") and its
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
prefill worker's NixlTransfer.metadata() that the server fetched from its side channel) is
admitted with request.kv_from_remote, waits in the scheduler's loading state with fresh pages
for its prompt, is filled by one NIXL read, has each page's checksum compared with the prefill
side's, and then runs from its prompt's end with the prefill side's first token as its first
output. A read that fails, times out or brings a page whose checksum differs fails that request
alone (the error says which page, never a checksum). A read that has not ended after timeout_s
is cancelled and its pages freed (held until NIXL confirms the cancel). Leading pages the decode
worker's own prefix cache holds are not read.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from frugal.disagg import HeldPagesFull, SlowRoute, faults
from frugal.disagg.connector import KVConnector, Loaded, TransferStats
from frugal.disagg.nixl import NixlTransfer
from frugal.disagg.params import KVLoad, bad, field, handoff_params, parse_load, prompt_hash
from frugal.disagg.probe import Route
from frugal.disagg.signing import SIGNATURE, Rejected, Replays, Signer
from frugal.request import FinishReason, Request
from frugal.worker.kv_pool import KVPool

logger = logging.getLogger("frugal")
PROBE_TIMEOUT_S = 5.0
PROBE_RETRY_S = 30.0  # a peer whose probe failed is probed again after this long


class NixlConnector(KVConnector):
    """Held prefill pages and loads in flight for one engine (engine thread only).

    scheduler: the engine's (its kv: KVCacheManager holds and frees pages); pool: the worker's;
    eos_token_ids: the model's (a decode's first token is computed again where the client's
    min_tokens forbids the prefill side's); config: the engine's EngineConfig (kv_role,
    kv_lease_s, kv_transfer_timeout_s, kv_secret, kv_address: the (host, port) decode workers
    reach this worker's side channel at, kv_max_held_fraction)."""

    def __init__(self, scheduler, pool: KVPool, engine_id: str, vocab_size: int,
                 eos_token_ids: set[int], config) -> None:
        self.scheduler, self.pool, self.vocab_size = scheduler, pool, vocab_size
        self.eos_token_ids = eos_token_ids
        self.role = config.kv_role
        self.lease_s, self.timeout_s = config.kv_lease_s, config.kv_transfer_timeout_s
        self.address = config.kv_address
        self.max_held_pages = int(config.kv_max_held_fraction * pool.num_pages)
        self.require_fast_path = config.kv_require_fast_path
        self.signer = Signer(config.kv_secret)
        self.transfer = NixlTransfer(pool, engine_id, map_peers=config.kv_transport == "auto")
        self.metadata = self.signer.sign(self.transfer.metadata())  # (the side channel's)
        self.faults = faults.from_env()
        self._replays = Replays()
        self._pinning: dict[str, int] = {}  # prefills for decode workers: pages they will hold
        self._pending: dict[str, KVLoad] = {}  # admitted loads: request_id -> where its KV is
        self._loads: dict[str, Request] = {}  # request_id -> request whose read is in flight
        self._abandoned: set[str] = set()  # loads whose request ended while its read ran
        self._failed: list[tuple[Request, str]] = []
        self._stats = TransferStats()
        self._routes: dict[str, Route] = {}  # engine_id -> its probe's finding (disagg.probe)
        self._to_probe: dict[str, str] = {}  # engine_id -> where, peers met but not yet probed
        self._probe_failed: dict[str, float] = {}  # engine_id -> when to probe it again

    # -- scheduler side: admission -----------------------------------------------------------

    def admit(self, request: Request, params: dict) -> None:
        """See KVConnector.admit (signing.Rejected for params this worker cannot verify)."""
        if params.get("do_remote_decode"):
            self._admit_prefill(request)
            return
        if self.role == "prefill":
            raise bad("do_remote_prefill", "this worker is a prefill worker (--kv-role prefill)")
        peer = params.get("peer")
        if not isinstance(peer, dict):
            raise ValueError("kv_transfer_params: the prefill worker's metadata is missing")
        fields = self.signer.verify({k: v for k, v in params.items() if k != "peer"})
        if fields.get("prompt_sha256") != prompt_hash(request.prompt_token_ids):
            raise bad("prompt_sha256", "the prefill worker ran a different prompt (the two "
                                       "workers tokenize it differently?)")
        engine_id = field(fields, "remote_engine_id", str)
        if engine_id != peer.get("engine_id"):
            raise bad("remote_engine_id", "the prefill worker's side channel answers for "
                                          "another engine (restarted?)")
        where = f"{fields.get('remote_host')}:{fields.get('remote_port')}"
        self.transfer.connect(peer, where)  # ValueError when its layout differs from ours
        self._check_route(engine_id, where)
        load = parse_load(fields, engine_id, -(-request.num_prompt_tokens // self.pool.page_size),
                          self.transfer.num_remote_pages(engine_id), self.vocab_size, where)
        if not self._replays.first(params[SIGNATURE], fields.get("expires_at")):
            raise Rejected()
        self._pending[request.request_id] = load
        request.kv_from_remote = True

    def _check_route(self, engine_id: str, where: str) -> None:
        """A peer met for the first time is probed (disagg.probe): in the background of the
        steps, or, with --kv-require-fast-path, before this admission, which a slow route or a
        failed probe refuses (SlowRoute, a 503; a failed probe is tried again after
        PROBE_RETRY_S)."""
        if time.monotonic() >= self._probe_failed.get(engine_id, float("inf")):
            del self._probe_failed[engine_id]
        if engine_id not in self._routes and engine_id not in self._probe_failed:
            self._to_probe.setdefault(engine_id, where)
            self._probe()  # (started before this peer's first read, when none is in flight)
            deadline = time.monotonic() + 2 * PROBE_TIMEOUT_S
            while (self.require_fast_path and time.monotonic() < deadline
                   and engine_id not in self._routes and engine_id not in self._probe_failed):
                self._probe(wait=True)
        if not self.require_fast_path:
            return
        route = self._routes.get(engine_id)
        if route is None or route.slow:
            logger.warning("a hand-off from %s refused (--kv-require-fast-path): %s", where,
                           "its route is slow" if route else "its probe has not succeeded")
            raise SlowRoute("kv_transfer_params: this decode worker takes hand-offs only over a "
                            "fast route (--kv-require-fast-path), and that prefill worker's is "
                            "not (its log says why)")

    def _probe(self, wait: bool = False) -> None:
        """Start the next peer's probe read when none is in flight; record one that ended (a
        warning, and a count when its route is slow)."""
        if not self.transfer.prober.busy and self._to_probe:
            engine_id = next(iter(self._to_probe))
            self.transfer.start_probe(engine_id, self._to_probe.pop(engine_id))
        route = self.transfer.prober.result(min(self.timeout_s, PROBE_TIMEOUT_S), wait)
        if route is None:
            return
        if route.error:
            self._probe_failed[route.engine_id] = time.monotonic() + PROBE_RETRY_S
            logger.warning("%s; tried again in %.0f s", route.describe(), PROBE_RETRY_S)
            return
        self._routes[route.engine_id] = route
        if not route.slow:
            logger.info("%s", route.describe())
            return
        self._stats.num_slow_routes += 1
        logger.warning("%s: SLOW, as every hand-off from there will be (UCX's route: "
                       "UCX_TLS; UCX's peer error handling rules out its shared-memory and CUDA "
                       "IPC transports, FRUGAL_UCX_ERROR_HANDLING=none allows them; on one "
                       "host, CUDA IPC needs one PID namespace)", route.describe())

    def _admit_prefill(self, request: Request) -> None:
        if self.role == "decode":
            raise bad("do_remote_decode", "this worker is a decode worker (--kv-role decode)")
        pages = -(-request.num_prompt_tokens // self.pool.page_size)
        held = sum(len(t) for k, (t, _) in self.scheduler.kv.held.items()
                   if k.startswith("lease:"))
        if held + sum(self._pinning.values()) + pages > self.max_held_pages:
            raise HeldPagesFull(
                f"kv_transfer_params: this prefill worker holds its share of KV pages for "
                f"decode workers ({self.max_held_pages} of {self.pool.num_pages}, "
                f"--kv-max-held-fraction); retry later or elsewhere")
        self._pinning[request.request_id] = pages
        # its one token stands for the decode side's first: sampled as there without
        # min_tokens (vllm-router sets 1 here; the decode side applies the client's)
        request.params = dataclasses.replace(request.params, min_tokens=0)
        request.max_total_tokens = min(request.max_total_tokens, request.num_prompt_tokens + 1)

    # -- scheduler side: endings -------------------------------------------------------------

    def request_finished(self, request: Request, reason: FinishReason
                         ) -> tuple[dict | None, tuple[str, float] | None]:
        """A prefill for a decode worker that ended well: its signed kv_transfer_params, its
        pages held under its lease. A load that ended (abort, error) before its KV came: the
        prefill side is told to free its pages, and this side's stay held while the read may
        still write them."""
        if self._pinning.pop(request.request_id, None) is not None and reason in (
                FinishReason.STOP, FinishReason.LENGTH):
            pages = list(request.page_table.ids)
            params = handoff_params(
                self.transfer.engine_id, request.request_id, pages, self.pool.checksums(pages),
                self.address, request.output_token_ids[0],
                request.logprobs[0] if request.logprobs else None, request.prompt_token_ids)
            return (self.signer.sign(params, ttl_s=self.lease_s),
                    ("lease:" + request.request_id, self.lease_s))
        load = self._pending.pop(request.request_id, None)
        if load is None:
            return None, None
        self.transfer.notify(load.engine_id, load.remote_request_id.encode())
        if request.request_id in self._loads:
            self._abandoned.add(request.request_id)
            return None, ("load:" + request.request_id, float("inf"))  # (until it ends)
        return None, None

    def poll(self) -> tuple[list[Loaded], list[tuple[Request, str]]]:
        """See KVConnector.poll. Frees the pages of expired leases, of reads the decode side
        announced done, and of reads given up after timeout_s."""
        for message in self.transfer.notifications():
            self.scheduler.release("lease:" + message.decode(errors="replace"))
        self._probe()
        for key in self.scheduler.kv.expired():
            self._stats.num_leases_expired += 1
            logger.warning("KV pages held for %s freed unread after %.0f s", key, self.lease_s)
            self.scheduler.release(key)
        loaded = []
        for request_id, error in self.transfer.done(self.faults.read_delay_s):
            request = self._loads.pop(request_id)
            if self._forgotten(request_id):
                continue
            error = error or self._verify(request)
            if error is None:
                self._stats.num_loads += 1
                self._stats.num_mapped_loads += self._pending[request_id].mapped
                loaded.append(self._loaded(request))
            else:
                self._fail(request, error)
        for request_id, request in list(self._loads.items()):
            age = self.transfer.in_flight(request_id)
            if age is None or age <= self.timeout_s:
                continue
            if self.transfer.cancel(request_id):  # it can no longer write our pages
                del self._loads[request_id]
                if self._forgotten(request_id):
                    continue
            elif request_id in self._abandoned:
                continue  # already failed; its pages stay held until the cancel succeeds
            self._fail(request, f"KV transfer from {self._pending[request_id].where} has not "
                                f"finished in {self.timeout_s:g} s")
        failed, self._failed = self._failed, []
        return loaded, failed

    def _forgotten(self, request_id: str) -> bool:
        """The read of a request that ended meanwhile is over: free its held pages."""
        if request_id not in self._abandoned:
            return False
        self._abandoned.discard(request_id)
        self.scheduler.release("load:" + request_id)
        return True

    def _loaded(self, request: Request) -> Loaded:
        """The prefill side samples without min_tokens (vllm-router sends it 1) and its own
        noise: where that matters, the last prompt token is computed again here."""
        load, p = self._pending.pop(request.request_id), request.params
        again = p.seed is not None or p.min_tokens > 0 and (
            load.first_token in p.stop_token_ids
            or not p.ignore_eos and load.first_token in self.eos_token_ids)
        return Loaded(request, request.num_prompt_tokens - again,
                      None if again else (load.first_token, load.first_logprob))

    @property
    def busy(self) -> bool:
        return bool(self._loads)

    def stats(self) -> TransferStats:
        return dataclasses.replace(self._stats)

    # -- worker side -------------------------------------------------------------------------

    def start_loads(self, requests: list[Request]) -> None:
        """Start one NIXL read of each request's prompt pages (those its own prefix cache
        lacks) into its pages."""
        for request in requests:
            load = self._pending[request.request_id]
            load.first_page = request.num_computed_tokens // self.pool.page_size
            load.mapped = self.transfer.maps(load.engine_id)
            try:
                self.transfer.read(request.request_id, list(request.page_table.ids)[
                                   load.first_page:], load.engine_id,
                                   load.remote_pages[load.first_page:],
                                   load.remote_request_id.encode())
                self._loads[request.request_id] = request
            except Exception as e:
                logger.warning("KV transfer from %s failed to start: %s", load.where, e)
                self._fail(request, f"KV transfer from {load.where} failed to start")

    def _verify(self, request: Request) -> str | None:
        """The arrived pages' checksums against the prefill side's (which page, never a
        checksum, in the error)."""
        load = self._pending[request.request_id]
        pages = list(request.page_table.ids)[load.first_page:]
        self.faults.after_read(self.pool, pages)
        sums = self.pool.checksums(pages)
        self._stats.bytes_loaded += len(pages) * (self.pool.num_bytes // self.pool.num_pages)
        for i, (got, want) in enumerate(zip(sums, load.checksums[load.first_page:]),
                                        load.first_page):
            if got != want:
                return (f"KV transfer from {load.where}: page {i} of the prompt arrived damaged "
                        "(its checksum differs from the prefill worker's)")
        return None

    def _fail(self, request: Request, error: str) -> None:
        self._stats.num_load_failures += 1
        self._failed.append((request, error))
