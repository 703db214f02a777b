"""The radix top-k (ops.triton.topk) against torch.topk on fresh random rows: several programs a
row, rows with fewer finite scores than k (and none), ties at the threshold, negative scores,
scores so close that only a key's lowest bytes tell them apart."""

import pytest
import torch

from tests.ops import launches

tri = pytest.importorskip("frugal.ops.triton.topk")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chosen_values(scores, positions):
    """Each row's chosen scores, sorted, -inf for a -1."""
    taken = scores.gather(1, positions.clamp(min=0).long())
    return torch.where(positions >= 0, taken, float("-inf")).sort(-1).values


@pytest.mark.parametrize("rows,n,k,masked,ties", [
    (1, 50, 16, 0.0, False), (3, 5000, 100, 0.0, False), (2, 4100, 33, 0.5, False),
    (3, 3000, 64, 0.99, False), (2, 3000, 500, 0.0, True), (1, 2048, 2048, 0.0, False),
    (2, 70, 70, 1.0, False), (2, 2500, 300, 0.0, "close")])
def test_top_positions(rows, n, k, masked, ties):
    check(rows, n, k, masked, ties)


@pytest.mark.parametrize("size", [512, 1024, 2048])
def test_every_program_size(size, monkeypatch):
    """Each size block() picks (by the step's scores), on rows that span several programs."""
    monkeypatch.setattr(tri, "block", lambda scores: size)
    check(3, 5000, 100, 0.1, False)
    check(2, 3000, 500, 0.0, True)


def test_bad_calls():
    scores = torch.zeros(2, 8, device=DEVICE)
    for k in (0, 9):
        with pytest.raises(ValueError, match="k = "):
            tri.top_positions(scores, k)
    with pytest.raises(ValueError, match="out"):
        tri.top_positions(scores, 4, out=torch.empty(2, 5, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="work"):
        tri.top_positions(scores, 4, work=tri.work_area(3, DEVICE))


def radix_keys(scores):
    """The 32-bit keys (as int64) the radix select orders fp32 scores by (topk._key, finite)."""
    bits = scores.view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)


def test_a_first_pass_counted_elsewhere(monkeypatch):
    """top_positions(work=) takes its first histogram as given (it runs passes 1-3 only):
    counted by the same byte rule (here in torch), it selects what the full run does."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 3000, generator=g) * 5
    scores[1, ::3] = float("-inf")
    keys = radix_keys(scores)
    work = tri.work_area(3, "cpu")
    for r in range(3):
        work[r, :256] = torch.bincount(keys[r][torch.isfinite(scores[r])] >> 24, minlength=256)
    levels = launches.record(monkeypatch, tri, "_histogram", "LEVEL")
    got = tri.top_positions(scores.to(DEVICE), 100, work=work.to(DEVICE)).cpu()
    want = tri.top_positions(scores.to(DEVICE), 100).cpu()
    assert torch.equal(chosen_values(scores, got), chosen_values(scores, want))
    assert levels == [1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("size", [512, 2048])
def test_dead_tails_are_not_read(size, monkeypatch):
    """A work area's dead tail (column DEAD) cuts each row: the scores past it, the largest of
    the row here, are never chosen; a row cut to fewer than k scores gets -1s after them, a row
    cut to none only -1s; the selection is the uncut row's top-k of what is left."""
    monkeypatch.setattr(tri, "block", lambda scores: size)
    g = torch.Generator().manual_seed(11)
    rows, n, k = 4, 5000, 100
    scores = torch.randn(rows, n, generator=g)
    lengths = [5000, 1300, 60, 0]
    work = tri.work_area(rows, "cpu")
    for r, length in enumerate(lengths):
        scores[r, length:] = 1e6 + torch.arange(n - length)  # (would win if read)
        work[r, tri.DEAD.value] = n - length
        work[r, :256] = torch.bincount(radix_keys(scores[r, :length]) >> 24, minlength=256)
    got = tri.top_positions(scores.to(DEVICE), k, work=work.to(DEVICE)).cpu()
    for r, length in enumerate(lengths):
        want = scores[r, :length].topk(min(k, length)).indices.sort().values
        taken = got[r][got[r] >= 0]
        assert torch.equal(taken.sort().values, want.int()), r
        assert bool((got[r, len(taken):] == -1).all())


def check(rows, n, k, masked, ties):
    g = torch.Generator().manual_seed(n + k)
    scores = torch.randn(rows, n, generator=g) * 5
    if ties == "close":  # one exponent, the top mantissa bits equal: the last bytes decide
        scores = 1.5 + torch.randn(rows, n, generator=g) * 1e-5  # (and fp32 makes ties)
    elif ties:
        scores = scores.round()
    scores[torch.rand(rows, n, generator=g) < masked] = float("-inf")
    # written into a buffer with a guard around it: no place outside the [rows, k] rows
    buffer = torch.full((rows + 2, k + 2), -7, dtype=torch.int32, device=DEVICE)
    got = tri.top_positions(scores.to(DEVICE), k, out=buffer[1:-1, 1:-1]).cpu()
    guard = buffer.cpu()
    assert bool((guard[[0, -1]] == -7).all() and (guard[:, [0, -1]] == -7).all())
    assert got.shape == (rows, k) and got.dtype == torch.int32
    values, picked = scores.topk(k, dim=-1, sorted=False)
    want = torch.where(values == float("-inf"), -1, picked).int()
    for row in got:  # no position twice, -1 only after the finite ones
        taken = row[row >= 0].tolist()
        assert len(set(taken)) == len(taken) and bool((row[len(taken):] == -1).all())
    assert torch.equal(chosen_values(scores, got), chosen_values(scores, want))
    if not ties:
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
