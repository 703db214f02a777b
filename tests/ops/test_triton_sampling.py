"""Triton argmax against torch.argmax on fresh random logits, ties, -inf and NaN rows."""

import pytest
import torch

tri = pytest.importorskip("frugal.ops.triton.sampling")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 9000])
def test_argmax_random(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype).to(DEVICE)
    assert torch.equal(tri.argmax(logits), logits.argmax(dim=-1))


def test_argmax_first_of_ties_and_special_rows():
    vocab = 9000  # (crosses a block of 4096)
    logits = torch.full((5, vocab), -1.0)
    logits[0, [7, 4100, 8999]] = 3.0  # a tie: the first index wins
    logits[1, [8999, 4096]] = 2.0
    logits[2] = float("-inf")  # nothing allowed: index 0, as torch
    logits[3, 5000] = float("nan")  # NaN counts as the largest, as torch
    logits[3, 10] = float("inf")
    logits[4, -1] = 0.5  # the last entry
    logits = logits.to(DEVICE)
    assert tri.argmax(logits).tolist() == [7, 4096, 0, 5000, 8999]
    assert tri.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_argmax_strided_rows_and_empty():
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = logits[:, :2000]  # rows of stride 3000
    assert torch.equal(tri.argmax(view), view.argmax(dim=-1))
    assert tri.argmax(logits[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_argmax_vocab_size_gpu():
    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(tri.argmax(logits), logits.argmax(dim=-1))
