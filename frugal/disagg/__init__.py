"""Prefill/decode disaggregation: prefill workers hand a request's KV pages to decode workers
over NIXL, in vLLM's kv_transfer_params protocol, so vllm-router fronts them unchanged."""


def wants_transfer(params: dict | None) -> bool:
    """kv_transfer_params that ask for a transfer (vllm-router sends them with every field null
    to a worker that should not take part)."""
    return bool(params and (params.get("do_remote_decode") or params.get("do_remote_prefill")))


class Unavailable(RuntimeError):
    """A hand-off this worker cannot take now or from that peer: the server answers 503 (which
    vllm-router may retry elsewhere) with `code` in the error body."""

    code = "kv_unavailable"


class HeldPagesFull(Unavailable):
    """A prefill for a decode worker refused: the pages held for decode workers are at their
    cap (--kv-max-held-fraction)."""

    code = "kv_pages_held"


class SlowRoute(Unavailable):
    """A decode worker with --kv-require-fast-path refusing a prefill worker whose hand-offs
    would go over TCP or through host memory (disagg.probe)."""

    code = "kv_slow_route"
