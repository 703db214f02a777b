"""What the engine-level hand-off tests share: a prefill and a decode engine of the default model
over real NIXL in one process (the `engines` fixture, tests/disagg/conftest.py), and helpers to
drive them as the server's loop would."""

import dataclasses
import time

from frugal.config import CacheConfig, EngineConfig
from frugal.disagg.signing import Signer
from frugal.request import SamplingParams, join

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "A recipe for pancakes: first, mix flour, milk and two eggs, then whisk",  # 2 pages
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=2)


SECRET = "test-secret-of-this-deployment"
SIGNER = Signer(SECRET)


def config(**kw) -> EngineConfig:
    return EngineConfig(dtype="float32", device="cpu", kv_secret=SECRET,
                        kv_address=("127.0.0.1", 1),
                        cache=CacheConfig(kv_cache_memory="64MiB"), **kw)


def drain(engine, peer=None, timeout: float = 120.0) -> dict:
    """Step until idle; peer: the other engine, polled meanwhile as its server loop would."""
    joined, deadline = {}, time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            join(joined, output)
        if peer is not None:
            peer.poll_transfers()
    assert not engine.has_unfinished_requests()
    return joined


def prefill(engine, prompts, params=GREEDY) -> dict:
    one = dataclasses.replace(params, max_tokens=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, one, f"p{i}", {"do_remote_decode": True})
    out = drain(engine)
    return {k: {**v.kv_transfer_params, "peer": engine.connector.metadata}
            for k, v in out.items()}


def resign(params: dict, **changes) -> dict:
    """params changed as the prefill worker itself could have signed them."""
    fields = {k: v for k, v in params.items() if k not in ("peer", "frugal_signature")}
    return {**SIGNER.sign({**fields, **changes}), "peer": params["peer"]}


def settle(*engines, timeout: float = 10.0) -> None:
    """Poll until every engine's pool is empty (the prefill side frees on the read's
    notification)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines:
            e.poll_transfers()
        if all(e.stats().num_pages_used == 0 for e in engines):
            break
        time.sleep(0.02)
    for e in engines:
        assert e.stats().num_pages_used == 0 and e.stats().num_pages_held == 0
        assert e.check_integrity()


def settle_lease(p, params) -> None:
    p.scheduler.release("lease:" + params["remote_request_id"])
    settle(p)
