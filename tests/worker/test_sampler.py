"""Sampler against straightforward references on fresh random logits."""

import pytest
import torch

from frugal.core.page_allocator import PageRef
from frugal.core.page_table import PageTable
from frugal.request import Request, SamplingParams
from frugal.worker.sampler import Sampler, apply_top_k_top_p, token_logprobs


def reqs(params: list[SamplingParams], generators=None, num_output=0) -> list[Request]:
    generators = generators or [None] * len(params)
    return [Request(str(i), None, [1], p, 1000, output_token_ids=[5] * num_output, generator=g)
            for i, (p, g) in enumerate(zip(params, generators))]


def reference_filter(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """One row, the obvious way: keep the k largest, then the smallest nucleus with mass >= p."""
    keep = torch.zeros_like(row, dtype=torch.bool)
    order = row.argsort(descending=True)
    kept = order[:k]
    probs = torch.softmax(row[kept], dim=0)
    mass = 0.0
    for idx, prob in zip(kept.tolist(), probs.tolist()):
        keep[idx] = True
        mass += prob
        if mass >= p:
            break
    return row.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=g) * 3
    top_k = torch.tensor([50, 1, 5, 50, 10, 3])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.9, 0.2])
    ours = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        ref = reference_filter(logits[i], int(top_k[i]), float(top_p[i]))
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), i
        assert torch.equal(ours[i][~torch.isinf(ref)], ref[~torch.isinf(ref)])


def test_greedy_and_degenerate_filters_pick_argmax():
    s = Sampler("cpu", 0, [2])
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=0)]
    assert torch.equal(s(logits, reqs(params)), logits.argmax(-1))


def test_sampling_follows_the_distribution():
    s = Sampler("cpu", 0, [2])
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * 20000
    tokens = s(logits, reqs(params))
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    expected = torch.softmax(logits[0], 0)
    assert (freq - expected).abs().max() < 0.015
    hot = s(logits, reqs([SamplingParams(temperature=5.0)] * 20000))
    assert torch.bincount(hot, minlength=5)[3] > torch.bincount(tokens, minlength=5)[3]


def test_top_k_and_top_p_restrict_support():
    s = Sampler("cpu", 0, [2])
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0]]).repeat(5000, 1)
    k2 = s(logits, reqs([SamplingParams(top_k=2)] * 5000))
    assert set(k2.tolist()) == {0, 1}
    nucleus = s(logits, reqs([SamplingParams(top_p=0.5)] * 5000))
    assert set(nucleus.tolist()) == {0, 1}


def test_seeded_rows_do_not_depend_on_the_batch():
    s = Sampler("cpu", 0, [2])
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = s(logits[1:2], reqs([p], [s.make_generator(7)]))
    batch = s(logits, reqs([SamplingParams(), p, SamplingParams()],
                           [None, s.make_generator(7), None]))
    assert batch[1] == alone[0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    s = Sampler("cpu", 0, [2])
    logits = torch.zeros(2, 10)
    logits[:, 2] = 50.0  # EOS is by far the best
    logits[:, 7] = 40.0  # then a stop token id
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    early = s(logits, reqs([p, p], num_output=1))
    assert early.tolist() != [2, 2] and 7 not in early.tolist()
    assert s(logits, reqs([p, p], num_output=3)).tolist() == [2, 2]
    assert s(logits[:1], reqs([SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)],
                              num_output=0)).tolist() == [2]


def test_token_logprobs_against_log_softmax():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    targets = torch.tensor([4, 0, 29])
    entries = token_logprobs(logits, targets, [0, 2, 5])
    ref = logits.log_softmax(-1)
    for i, e in enumerate(entries):
        assert e.token_id == targets[i] and abs(e.logprob - ref[i, targets[i]].item()) < 1e-6
        assert len(e.top) == [0, 2, 5][i]
        assert [t for t, _ in e.top] == ref[i].topk(len(e.top)).indices.tolist()


@pytest.mark.gpu
def test_sampling_and_step_inputs_leave_the_device_queue_alone():
    """Sampling with temperature / top-k / top-p / min_tokens and preparing a step's inputs
    return while the device is still busy: host lists reach it through pinned copies, never
    torch.tensor(..., device=), which waits for the device (and would undo the overlap of a
    decode step launched ahead)."""
    import time

    from frugal.core.scheduler import SchedulerOutput
    from frugal.worker.step_inputs import prepare

    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_tokens=4),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    requests = reqs(params)
    for i, r in enumerate(requests):
        r.page_table = PageTable(PageRef(10 * i + j, 1) for j in range(3))
    logits = torch.randn(3, 1000, device="cuda")
    sampler = Sampler("cuda", 0, [2])
    out = SchedulerOutput(requests, [1, 1, 1])
    sampler(logits, requests)  # the first calls load kernels, which waits
    prepare(out, 16, "cuda", check=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time
    start = time.perf_counter()
    tokens = sampler(logits, requests)
    inputs = prepare(out, 16, "cuda", check=True)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    assert elapsed < 0.2, elapsed
    assert tokens.shape == (3,) and inputs.meta.page_table.shape == (3, 3)
