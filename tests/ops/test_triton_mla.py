"""The Triton MLA decode kernel (ops.triton.mla_decode) against torch_ref.mla_attention on fresh
random latent caches: page tables in any order, contexts shorter and longer than a split, a
request with an empty context."""

import pytest
import torch

from frugal.ops import torch_ref

tri = pytest.importorskip("frugal.ops.triton.mla_decode")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(lens, heads, lat, rope, dtype, page_size=16, seed=0, max_seq_len=None):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    pages_each = max(-(-n // page_size) for n in lens) or 1
    num_pages = batch * pages_each + 3
    cache = torch.randn(num_pages, page_size, 1, lat + rope, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: batch * pages_each].view(batch, -1).int()
    q = torch.randn(batch, heads, lat + rope, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = (lat + rope) ** -0.5
    ref = torch_ref.mla_attention(q.float(), cache.float(), table,
                                  torch.arange(batch + 1, dtype=torch.int32), seq_lens, scale, 1,
                                  max(lens), lat, num_decodes=batch)
    got = tri.mla_decode(q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE),
                         seq_lens.to(DEVICE), scale, max_seq_len or max(lens), lat)
    assert got.shape == (batch, heads, lat) and got.dtype == dtype
    return got.float().cpu(), ref


@pytest.mark.parametrize("lens,heads", [([1], 4), ([5, 40, 17], 4), ([300, 3], 20),
                                        ([0, 33], 16)])
def test_mla_decode_matches_torch_ref(lens, heads):
    got, ref = run(lens, heads, 32, 16, torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_seq_len", [2048, 65536])
def test_contexts_far_shorter_than_the_launch(max_seq_len):
    """A launch sized for a longer context (a CUDA graph's max_model_len: 32 and 264 splits of
    the one request) cuts each request's own context at run time: 100, 7 and 0
    keys, the splits past them store no output, the merge reads none."""
    got, ref = run([100, 7, 0], 16, 32, 16, torch.float32, max_seq_len=max_seq_len)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 3, 16, 40])
def test_merge_of_splits(splits):
    """The one-launch merge against softmax over the splits' log-sum-exps: splits that saw no
    key (-inf) weigh nothing, a row where none did is 0, more splits than one step takes."""
    g = torch.Generator().manual_seed(splits)
    part = torch.randn(3, splits, 5, 256, generator=g)
    lse = torch.randn(3, splits, 5, generator=g) * 4
    lse[0, -1] = float("-inf")  # (the last split of request 0 past its end)
    lse[2, :, 1] = float("-inf")  # (request 2, head 1: nothing)
    lse[1, 0, 2] = float("-inf")  # (a split that saw only masked keys: DSA's -1 positions)
    want = (part * torch.softmax(lse, 1).nan_to_num(0.0)[..., None]).sum(1)
    part[lse == float("-inf")] = float("nan")  # (never written: never read)
    got = tri.merge(part.to(DEVICE), lse.to(DEVICE), torch.float32).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[2, 1].any()


def test_mla_decode_support():
    assert tri.supported(512, 64) and tri.supported(32, 16)
    assert not tri.supported(32, 8) and not tri.supported(96, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1, 7], [4096, 100], [32768]])
def test_mla_decode_bf16_kimi_shapes_gpu(lens):
    got, ref = run(lens, 64, 512, 64, torch.bfloat16)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_mla_attention_mixed_step_matches_torch_ref():
    """Decodes first (the kernel), then a request with 7 prompt tokens (PyTorch)."""
    from frugal.ops.triton.mla_decode import mla_attention

    g = torch.Generator().manual_seed(3)
    lat, rope, heads, page_size = 32, 16, 4, 16
    cache = torch.randn(12, page_size, 1, lat + rope, generator=g)
    table = torch.randperm(12, generator=g)[:9].view(3, 3).int()
    seq_lens = torch.tensor([20, 9, 30], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    q = torch.randn(9, heads, lat + rope, generator=g)
    args = (cu, seq_lens, 0.2, 7, 30, lat, 2)
    ref = torch_ref.mla_attention(q, cache, table, *args)
    got = mla_attention(q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), cu.to(DEVICE),
                        seq_lens.to(DEVICE), *args[2:])
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
