"""Hand-offs a client could try to turn against the workers, between two engines in one process
over real NIXL: params it made, altered, replayed or let expire are refused before any read;
malformed fields are 400s; each role refuses the other's params; pages held for decode workers
are capped; a read that stalls is given up and its pages freed; a prefill worker that died fails
only its requests; a peer claiming a huge pool costs nothing."""

import dataclasses
import time

import pytest

from frugal.disagg import HeldPagesFull, faults
from frugal.disagg.signing import REJECTED
from tests.disagg.engines import GREEDY, PROMPTS, drain, prefill, resign, settle, settle_lease

pytest.importorskip("nixl_cu13")


def _no_read_started(d) -> bool:
    return not d.connector.busy and not d.has_unfinished_requests()


def test_params_a_client_made_altered_replayed_or_let_expire_are_refused(engines):
    """Each refused at admission, before any connect or read, with one message that tells
    nothing (no checksum, no page)."""
    p, d = engines
    params = prefill(p, PROMPTS[:2])
    victim, mine = params["p0"], params["p1"]
    unsigned = {k: v for k, v in mine.items() if k != "frugal_signature"}
    forged = {**unsigned, "frugal_signature": "0" * 64}
    other_pages = {**mine, "remote_block_ids": victim["remote_block_ids"]}  # another user's
    other_sums = {**mine, "page_checksums": [s ^ 1 for s in mine["page_checksums"]]}
    elsewhere = {**mine, "remote_host": "10.0.0.1"}
    expired = resign(mine, expires_at=int(time.time()) - 1)
    for i, bad in enumerate([unsigned, forged, other_pages, other_sums, elsewhere, expired]):
        with pytest.raises(ValueError) as e:
            d.add_request(PROMPTS[1], GREEDY, f"bad{i}", bad)
        assert str(e.value) == REJECTED
        assert _no_read_started(d)
    d.add_request(PROMPTS[1], GREEDY, "once", mine)
    assert drain(d, p)["once"].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="not a valid hand-off"):  # replayed
        d.add_request(PROMPTS[1], GREEDY, "twice", mine)
    assert _no_read_started(d)
    d.add_request(PROMPTS[0], GREEDY, "victim", victim)  # the victim's own is unharmed
    assert drain(d, p)["victim"].outputs[0].finish_reason == "length"
    settle(p, d)


@pytest.mark.parametrize("bad", [
    {"first_logprob": {"token_id": "x", "logprob": "-1.0", "top": []}},
    {"first_logprob": {"token_id": 1, "logprob": "nan", "top": []}},
    {"first_logprob": {"token_id": 1, "logprob": -0.5, "top": []}},
    {"first_logprob": [1, 2]},
    {"remote_block_ids": [-1]},
    {"remote_block_ids": [10**9]},
    {"first_token_id": -3},
], ids=["logprob-token", "logprob-nan", "logprob-float", "logprob-shape", "negative-page",
        "far-page", "token"])
def test_malformed_params_are_a_value_error(engines, bad):
    """Even signed (by a prefill worker of another build): a ValueError (a 400), never a
    crash."""
    p, d = engines
    params = prefill(p, PROMPTS[:1])["p0"]
    # (a float cannot be signed: vllm-router may move it by an ulp; params with one fail
    # verification)
    bad = {**params, **bad} if "0.5" in repr(bad) else resign(params, **bad)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        d.add_request(PROMPTS[0], GREEDY, "m", bad)
    assert _no_read_started(d)
    settle_lease(p, params)


def test_roles_refuse_the_other_roles_params(engines):
    p, d = engines
    with pytest.raises(ValueError, match="decode worker"):
        d.add_request(PROMPTS[0], GREEDY, "r1", {"do_remote_decode": True})
    params = prefill(p, PROMPTS[:1])["p0"]
    with pytest.raises(ValueError, match="prefill worker"):
        p.add_request(PROMPTS[0], GREEDY, "r2", params)
    settle_lease(p, params)


def test_pages_held_for_decode_workers_are_capped(engines):
    """Prefills for decode workers stop at kv_max_held_fraction of the pool (HeldPagesFull, a
    503), so a pinning client cannot take the pool from normal requests."""
    p, _ = engines
    cap = p.connector.max_held_pages
    assert cap == p.runner.pool.num_pages // 2
    prompt = " ".join(["word"] * 150)  # 10 pages of 16
    pages = -(-len(p.tokenize(prompt)) // 16)
    one = dataclasses.replace(GREEDY, max_tokens=1)
    admitted = 0
    with pytest.raises(HeldPagesFull, match="kv-max-held-fraction"):
        for i in range(cap // pages + 2):
            p.add_request(prompt, one, f"pin{i}", {"do_remote_decode": True})
            admitted += 1
    assert admitted == cap // pages
    drain(p)
    assert p.stats().num_pages_held == admitted * pages <= cap
    for i in range(admitted):
        p.scheduler.release(f"lease:pin{i}")
    settle(p)


def test_a_stalled_read_is_given_up_and_its_pages_freed(engines, monkeypatch):
    """Past the timeout the read is cancelled: its request fails at once; its pages stay held
    while NIXL cannot cancel it yet (it could still write them), and are freed once it can."""
    p, d = engines
    params = prefill(p, PROMPTS[2:3])["p0"]
    d.connector.faults = faults.Faults(read_delay_s=60.0)  # its end is never looked at
    d.connector.timeout_s = 0.3
    cancel, refusals = d.connector.transfer.cancel, []

    def cancel_later(key):  # NIXL refuses the first cancels (the transfer is still active)
        refusals.append(key)
        return len(refusals) > 3 and cancel(key)

    monkeypatch.setattr(d.connector.transfer, "cancel", cancel_later)
    try:
        d.add_request(PROMPTS[2], GREEDY, "stall", params)
        out = drain(d, p, timeout=10)["stall"].outputs[0]
        assert out.finish_reason == "error" and "has not finished in 0.3 s" in out.error
        assert d.stats().num_pages_held == 2 and d.connector.busy  # the cancel is refused
        deadline = time.monotonic() + 5
        while d.connector.busy and time.monotonic() < deadline:
            d.poll_transfers()
        assert len(refusals) == 4 and d.connector.transfer.in_flight("stall") is None
        assert d.stats().num_pages_used == 0 and d.stats().num_pages_held == 0
    finally:
        d.connector.faults = faults.Faults()
        d.connector.timeout_s = 30.0
    settle(p, d)


def test_a_prefill_worker_that_died_fails_only_its_requests(engines, monkeypatch):
    """NIXL raises for a peer that is gone (a read, a notification): those requests fail alone,
    the engine goes on."""
    p, d = engines
    if d.connector.transfer.copies is not None:
        pytest.skip("NIXL's disconnect; a mapped peer that died: test_pd_attacks")
    params = prefill(p, PROMPTS[:2])
    agent = d.connector.transfer.agent

    def gone(*args, **kwargs):
        raise RuntimeError("nixlRemoteDisconnectError('NIXL_ERR_REMOTE_DISCONNECT')")

    with monkeypatch.context() as m:
        m.setattr(agent, "transfer", gone)
        m.setattr(agent, "send_notif", gone)
        d.add_request(PROMPTS[0], GREEDY, "dead", params["p0"])
        out = drain(d)["dead"].outputs[0]
    assert out.finish_reason == "error" and "failed to start" in out.error
    assert d.stats().num_pages_used == 0 and d.stats().num_pages_held == 0
    d.add_request(PROMPTS[1], GREEDY, "alive", params["p1"])
    assert drain(d, p)["alive"].outputs[0].finish_reason == "length"
    p.scheduler.release("lease:p0")
    settle(p, d)


def test_a_huge_pool_claim_costs_nothing(engines):
    """A peer claiming 100,000 pages: connecting builds nothing per page (under 10 ms), and a
    page id past what it claims is refused."""
    p, d = engines
    params = prefill(p, PROMPTS[:1])["p0"]
    d.connector.transfer.connect({**params["peer"], "engine_id": "frugal-warm"}, "test")  # UCX's
    peer = {**params["peer"], "engine_id": "frugal-huge", "num_pages": 100_000}  # first: ~8 ms
    start = time.perf_counter()
    d.connector.transfer.connect(peer, "test")
    assert time.perf_counter() - start < 0.01
    with pytest.raises(ValueError, match="not an integer"):
        d.connector.transfer.connect({**peer, "engine_id": "frugal-huger", "num_pages": 1 << 40},
                                   "test")
    settle_lease(p, params)
