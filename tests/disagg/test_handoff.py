"""Prefill/decode hand-off between two engines in one process, over real NIXL (UCX, DRAM):
a prefill engine's pages read by a decode engine give the co-located engine's greedy tokens and
log-probabilities; a layout mismatch is refused at admission; a corrupted page, an abort while
the read is in flight, a read that stalls and a lease that runs out each end as they should,
with both pools whole afterwards; params a client made, altered, replayed or let expire are
refused before any read; pages held for decode workers are capped."""

import dataclasses
import time

import pytest

from frugal.config import CacheConfig, EngineConfig
from frugal.disagg import HeldPagesFull, faults
from frugal.disagg.signing import REJECTED, Signer
from frugal.engine.llm_engine import LLMEngine
from frugal.request import SamplingParams, join

pytest.importorskip("nixl_cu13")

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


@pytest.fixture(scope="module")
def engines():
    return (LLMEngine(config(kv_role="prefill", kv_lease_s=30.0)),
            LLMEngine(config(kv_role="decode")))


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
    return {k: {**v.kv_transfer_params, "peer": engine.handoff.metadata}
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


def test_decode_of_a_remote_prefill_matches_colocated(engines, llm):
    p, d = engines
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(prompt, GREEDY, f"c{i}")
    reference = drain(llm.engine)
    params = prefill(p, PROMPTS)
    assert p.stats().num_pages_held == sum(len(v["remote_block_ids"]) for v in params.values())
    loads = d.stats().num_kv_loads
    for i, prompt in enumerate(PROMPTS):
        d.add_request(prompt, GREEDY, f"d{i}", params[f"p{i}"])
    out = drain(d, p)
    for i in range(len(PROMPTS)):
        want, got = reference[f"c{i}"].outputs[0], out[f"d{i}"].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=1e-5)
        assert [t for t, _ in got.logprobs[0].top] == [t for t, _ in want.logprobs[0].top]
    assert d.stats().num_kv_loads == loads + len(PROMPTS)
    settle(p, d)


def test_layout_mismatch_is_refused_at_admission(engines):
    p, d = engines
    params = prefill(p, PROMPTS[:1])["p0"]
    peer = {**params["peer"], "engine_id": "frugal-other",
            "layout": {**params["peer"]["layout"], "kv_cache_dtype": "float8_e4m3fn"}}
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'float8_e4m3fn' there, 'float32' here"):
        d.add_request(PROMPTS[0], GREEDY, "x", {**resign(params, remote_engine_id="frugal-other"),
                                                "peer": peer})
    with pytest.raises(ValueError, match="remote_block_ids: expected 1 integers"):
        d.add_request(PROMPTS[0], GREEDY, "y", resign(params, remote_block_ids=[0, 1]))
    with pytest.raises(ValueError, match="prompt_sha256"):
        d.add_request(PROMPTS[1], GREEDY, "z", params)
    assert not d.has_unfinished_requests()
    d.add_request(PROMPTS[0], GREEDY, "ok", params)  # the lease is still good
    assert drain(d, p)["ok"].outputs[0].finish_reason == "length"
    settle(p, d)


def test_corrupted_page_fails_its_request_alone(engines):
    p, d = engines
    params = prefill(p, PROMPTS)
    failures = d.stats().num_kv_load_failures
    d.handoff.faults = faults.Faults(corrupt_load=2)
    try:
        for i, prompt in enumerate(PROMPTS):
            d.add_request(prompt, GREEDY, f"d{i}", params[f"p{i}"])
        out = drain(d, p)
    finally:
        d.handoff.faults = faults.Faults()
    reasons = [out[f"d{i}"].outputs[0].finish_reason for i in range(len(PROMPTS))]
    assert reasons.count("error") == 1 and reasons.count("length") == len(PROMPTS) - 1
    bad = next(out[f"d{i}"].outputs[0] for i in range(len(PROMPTS))
               if reasons[i] == "error")
    assert "checksum" in bad.error and bad.token_ids == []
    assert "0x" not in bad.error  # which page, never a checksum
    assert d.stats().num_kv_load_failures == failures + 1
    settle(p, d)


def test_abort_while_the_read_is_in_flight_frees_both_pools(engines):
    p, d = engines
    params = prefill(p, PROMPTS[2:3])["p0"]
    d.handoff.faults = faults.Faults(read_delay_s=1.0)
    try:
        d.add_request(PROMPTS[2], GREEDY, "a", params)
        d.step()  # admitted: pages taken, the read started
        assert d.scheduler.loading and d.handoff.busy
        out = d.abort_request("a")
        assert out.outputs[0].finish_reason == "abort"
        assert d.stats().num_pages_held == 2  # its read may still write them
        settle(d, p)
    finally:
        d.handoff.faults = faults.Faults()


def test_unread_prefill_pages_are_freed_when_the_lease_runs_out(engines):
    p, _ = engines
    p.handoff.lease_s = 0.2
    try:
        prefill(p, PROMPTS[:2])
        assert p.stats().num_pages_held == 2
        expired = p.stats().num_kv_leases_expired
        time.sleep(0.3)
        settle(p)
        assert p.stats().num_kv_leases_expired == expired + 2
    finally:
        p.handoff.lease_s = 30.0


def test_a_worker_without_kv_role_refuses_transfer_params(llm):
    with pytest.raises(ValueError, match="--kv-role"):
        llm.engine.add_request("hi", GREEDY, "q", {"do_remote_decode": True})


EOS_FIRST = "What do you know about the sea."  # the model's greedy first token is EOS


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6, temperature=0),
    SamplingParams(max_tokens=6, temperature=0, min_tokens=3, logprobs=1),  # EOS must wait
    SamplingParams(max_tokens=6, temperature=0.8, seed=7),  # the decode side's own noise
], ids=["eos-first", "min-tokens", "seeded"])
def test_first_token_as_colocated(engines, llm, params):
    """vllm-router asks the prefill worker for min_tokens 1: the first token still follows the
    client's min_tokens (computed again on the decode side where it differs) and seed."""
    p, d = engines
    prompts = [EOS_FIRST, PROMPTS[0]]
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(prompt, params, f"c{i}")
    reference = drain(llm.engine)
    kv = prefill(p, prompts, dataclasses.replace(params, min_tokens=1))
    for i, prompt in enumerate(prompts):
        d.add_request(prompt, params, f"d{i}", kv[f"p{i}"])
    out = drain(d, p)
    for i in range(len(prompts)):
        assert out[f"d{i}"].outputs[0].token_ids == reference[f"c{i}"].outputs[0].token_ids
    settle(p, d)


def test_decode_worker_reads_only_what_its_cache_lacks(engines, llm):
    """A decode worker that computed a prompt's head before reads only the pages after it."""
    p, d = engines
    head = PROMPTS[3]
    prompt = head + " 30 31 32 33 34 35 36 37 38 39 40"
    llm.engine.add_request(prompt, GREEDY, "c-long")
    want = drain(llm.engine)["c-long"].outputs[0]
    d.add_request(head, GREEDY, "warm")  # computed here: its full pages stay cached
    drain(d)
    num_pages = -(-len(d.tokenize(prompt)) // 16)
    cached = len(d.tokenize(head)) // 16
    params = prefill(p, [prompt])["p0"]
    before, hits = d.stats().kv_bytes_loaded, d.stats().prefix_cache_hits
    d.add_request(prompt, GREEDY, "d-long", params)
    got = drain(d, p)["d-long"].outputs[0]
    assert got.token_ids == want.token_ids
    page_bytes = d.runner.pool.num_bytes // d.runner.pool.num_pages
    hit_pages = (d.stats().prefix_cache_hits - hits) // 16  # (the warm-up's output counts too)
    assert cached >= 2 and cached <= hit_pages < num_pages
    assert d.stats().kv_bytes_loaded - before == (num_pages - hit_pages) * page_bytes
    settle(p, d)


def _no_read_started(d) -> bool:
    return not d.handoff.busy and not d.has_unfinished_requests()


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


def settle_lease(p, params) -> None:
    p.scheduler.release("lease:" + params["remote_request_id"])
    settle(p)


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
    cap = p.handoff.max_held_pages
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
    d.handoff.faults = faults.Faults(read_delay_s=60.0)  # its end is never looked at
    d.handoff.timeout_s = 0.3
    cancel, refusals = d.handoff.transfer.cancel, []

    def cancel_later(key):  # NIXL refuses the first cancels (the transfer is still active)
        refusals.append(key)
        return len(refusals) > 3 and cancel(key)

    monkeypatch.setattr(d.handoff.transfer, "cancel", cancel_later)
    try:
        d.add_request(PROMPTS[2], GREEDY, "stall", params)
        out = drain(d, p, timeout=10)["stall"].outputs[0]
        assert out.finish_reason == "error" and "has not finished in 0.3 s" in out.error
        assert d.stats().num_pages_held == 2 and d.handoff.busy  # the cancel is refused
        deadline = time.monotonic() + 5
        while d.handoff.busy and time.monotonic() < deadline:
            d.poll_transfers()
        assert len(refusals) == 4 and not d.handoff.transfer._reads
        assert d.stats().num_pages_used == 0 and d.stats().num_pages_held == 0
    finally:
        d.handoff.faults = faults.Faults()
        d.handoff.timeout_s = 30.0
    settle(p, d)


def test_a_prefill_worker_that_died_fails_only_its_requests(engines, monkeypatch):
    """NIXL raises for a peer that is gone (a read, a notification): those requests fail alone,
    the engine goes on."""
    p, d = engines
    params = prefill(p, PROMPTS[:2])
    agent = d.handoff.transfer.agent

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
    d.handoff.transfer.connect({**params["peer"], "engine_id": "frugal-warm"}, "test")  # UCX's
    peer = {**params["peer"], "engine_id": "frugal-huge", "num_pages": 100_000}  # first: ~8 ms
    start = time.perf_counter()
    d.handoff.transfer.connect(peer, "test")
    assert time.perf_counter() - start < 0.01
    with pytest.raises(ValueError, match="not an integer"):
        d.handoff.transfer.connect({**peer, "engine_id": "frugal-huger", "num_pages": 1 << 40},
                                   "test")
    settle_lease(p, params)
