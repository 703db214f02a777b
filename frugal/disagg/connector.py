"""The seam between the engine and whatever moves KV pages to and from other workers.

A KVConnector has two halves, as vLLM's KVConnectorBase_V1 does (here both run on the engine
thread, one call after another):
- the scheduler side decides what waits for or sends KV: `admit` binds a new request to its
  kv_transfer_params (a prefill for a decode worker, or a decode whose prompt's KV comes from a
  prefill worker: then `request.kv_from_remote`, and the scheduler gives it pages and keeps it
  `loading`); `request_finished` says what a finished request hands on (its kv_transfer_params)
  and which of its pages stay held; `poll` reports loads that ended (to run from their
  prompt's end) or failed, and frees the pages other workers are done with;
- the worker side moves pages: `start_loads` starts reading the prompts' pages of the requests
  the scheduler just admitted to `loading`, into their pages; what the connector's peers need
  to reach this worker's pool is its own (NixlConnector.metadata).

NullConnector is the engine's without --kv-role: every transfer refused, nothing to poll.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from frugal.request import FinishReason, Request, TokenLogprob


@dataclass
class Loaded:
    """A request whose prompt's KV arrived: it runs from num_computed_tokens (its prompt's
    length, or one less to compute the last token again here); first: the token the other
    worker sampled after the prompt and its log-probability, to record as its first output
    (None when this worker computes it again)."""

    request: Request
    num_computed_tokens: int
    first: tuple[int, TokenLogprob | None] | None


@dataclass
class TransferStats:
    num_loads: int = 0  # prompts whose KV came from another worker
    num_mapped_loads: int = 0  # of those, copied from its pool mapped here (disagg.direct)
    num_load_failures: int = 0  # loads that failed, timed out or failed their checksum
    num_leases_expired: int = 0  # pages held for a peer that never read them
    bytes_loaded: int = 0
    num_slow_routes: int = 0  # prefill workers whose probe read went over TCP or host memory


class KVConnector(ABC):
    """KV pages to and from other workers (engine thread only). role: "prefill", "decode",
    "both", or None for no transfers."""

    role: str | None = None

    # -- scheduler side ----------------------------------------------------------------------

    @abstractmethod
    def admit(self, request: Request, params: dict) -> None:
        """Bind a new request to kv_transfer_params that want a transfer
        (disagg.wants_transfer); ValueError naming what is wrong, HeldPagesFull when this
        worker holds all the pages it may for others."""

    @abstractmethod
    def request_finished(self, request: Request, reason: FinishReason
                         ) -> tuple[dict | None, tuple[str, float] | None]:
        """(kv_transfer_params to hand on, or None; (key, timeout) to keep its pages held
        under, for Scheduler.finish, or None to free them)."""

    @abstractmethod
    def poll(self) -> tuple[list[Loaded], list[tuple[Request, str]]]:
        """Loads that ended intact, and requests whose load failed (with why)."""

    @property
    def busy(self) -> bool:
        """Transfers are in flight (the engine polls often while idle)."""
        return False

    def stats(self) -> TransferStats:
        return TransferStats()

    # -- worker side -------------------------------------------------------------------------

    @abstractmethod
    def start_loads(self, requests: list[Request]) -> None:
        """Start filling the pages of requests the scheduler just admitted to loading."""


class NullConnector(KVConnector):
    """No transfers: the engine of a worker started without --kv-role."""

    def admit(self, request: Request, params: dict) -> None:
        raise ValueError("kv_transfer_params: this worker was started without --kv-role")

    def request_finished(self, request: Request, reason: FinishReason
                         ) -> tuple[dict | None, tuple[str, float] | None]:
        return None, None

    def poll(self) -> tuple[list[Loaded], list[tuple[Request, str]]]:
        return [], []

    def start_loads(self, requests: list[Request]) -> None:
        if requests:
            raise RuntimeError("NullConnector: no request can wait for remote KV")
