"""Prefill/decode hand-off between two engines in one process, over real NIXL (UCX, DRAM):
a prefill engine's pages read by a decode engine give the co-located engine's greedy tokens and
log-probabilities; a layout mismatch is refused at admission; a corrupted page, an abort while
the read is in flight and a lease that runs out each end as they should, with both pools whole
afterwards."""

import dataclasses
import time

import pytest

from frugal.disagg import faults
from frugal.request import SamplingParams
from tests.disagg.engines import GREEDY, PROMPTS, drain, prefill, resign, settle

pytest.importorskip("nixl_cu13")


def test_decode_of_a_remote_prefill_matches_colocated(engines, llm):
    p, d = engines
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(prompt, GREEDY, f"c{i}")
    reference = drain(llm.engine)
    params = prefill(p, PROMPTS)
    assert p.stats().num_pages_held == sum(len(v["remote_block_ids"]) for v in params.values())
    loads, mapped = d.stats().num_kv_loads, d.stats().num_kv_mapped_loads
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
    # the pool maps here (one process, a CPU pool in a memory file) unless NIXL is asked for
    assert d.stats().num_kv_mapped_loads == mapped + (
        len(PROMPTS) if d.connector.transfer.copies is not None else 0)
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
    d.connector.faults = faults.Faults(corrupt_load=2)
    try:
        for i, prompt in enumerate(PROMPTS):
            d.add_request(prompt, GREEDY, f"d{i}", params[f"p{i}"])
        out = drain(d, p)
    finally:
        d.connector.faults = faults.Faults()
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
    d.connector.faults = faults.Faults(read_delay_s=1.0)
    try:
        d.add_request(PROMPTS[2], GREEDY, "a", params)
        d.step()  # admitted: pages taken, the read started
        assert d.scheduler.loading and d.connector.busy
        out = d.abort_request("a")
        assert out.outputs[0].finish_reason == "abort"
        assert d.stats().num_pages_held == 2  # its read may still write them
        settle(d, p)
    finally:
        d.connector.faults = faults.Faults()


def test_unread_prefill_pages_are_freed_when_the_lease_runs_out(engines):
    p, _ = engines
    p.connector.lease_s = 0.2
    try:
        prefill(p, PROMPTS[:2])
        assert p.stats().num_pages_held == 2
        expired = p.stats().num_kv_leases_expired
        time.sleep(0.3)
        settle(p)
        assert p.stats().num_kv_leases_expired == expired + 2
    finally:
        p.connector.lease_s = 30.0


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


def test_page_runs_pair_the_same_pages():
    """A read's descriptors: one per chunk and stretch where both sides' pages go up by one."""
    from frugal.disagg.layout import page_runs

    local, remote = [4, 5, 6, 9, 10, 3, 2], [20, 21, 22, 23, 24, 7, 8]
    runs = page_runs(local, remote)
    assert runs == [(4, 20, 3), (9, 23, 2), (3, 7, 1), (2, 8, 1)]
    assert [(a + i, b + i) for a, b, n in runs for i in range(n)] == list(zip(local, remote))
    assert page_runs(list(range(256)), list(range(100, 356))) == [(0, 100, 256)]
    assert page_runs([], []) == []
