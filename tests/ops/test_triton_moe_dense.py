"""INT4 experts at prompt sizes (ops.triton.moe_dense): dequantized a chunk of experts at a
time, then multiplied on the float path, against torch_ref on fresh random inputs."""

import pytest
import torch

from frugal.ops import torch_ref
from frugal.quant.experts import quantize_experts, stack
from frugal.quant.int4 import quantize_rtn

tri = pytest.importorskip("frugal.ops.triton.moe")
dense = pytest.importorskip("frugal.ops.triton.moe_dense")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,group", [(640, 32), (96, 16), (2048, 1024), (768, 768)])
def test_dequantize_a_chunk_as_each_expert_does(dtype, k, group):
    """Experts 1 and 2 of 4 (rows and words past one program's block; groups whole within a
    program, a program within one group, neither) into a buffer, each as
    Int4Experts.expert(e).dequantize(dtype) (the interpreter's bf16 stores truncate: within
    one bf16 step there; equal on the GPU)."""
    g = torch.Generator().manual_seed(k + group)
    w = stack([quantize_rtn(e, group, symmetric=True) for e in torch.randn(4, 24, k, generator=g)])
    assert w.group_size == group
    out = torch.full((2, 24, k), float("nan"), dtype=dtype)
    got = dense.dequantize(w.to(DEVICE), 1, out.to(DEVICE)).cpu()
    for i, e in enumerate((1, 2)):
        want = w.expert(e).dequantize(dtype)
        if dtype == torch.float32 or DEVICE == "cuda":
            assert torch.equal(got[i], want), e
        else:
            torch.testing.assert_close(got[i].float(), want.float(), atol=0, rtol=2**-7)


def test_dequantize_refuses_experts_past_the_stack():
    w = quantize_experts(torch.randn(3, 8, 64), "int4")
    with pytest.raises(ValueError, match="experts 2\\+2"):
        dense.dequantize(w, 2, torch.empty(2, 8, 64))


def test_takes_int4_experts_from_dense_slots_an_expert():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 16, 64, generator=g)
    int4, fp8 = quantize_experts(w, "int4"), quantize_experts(w, "fp8")
    slots = dense.DENSE_SLOTS * 4
    assert dense.takes(int4, slots) and not dense.takes(int4, slots - 1)
    assert not dense.takes(fp8, 10 * slots) and not dense.takes(w, 10 * slots)


@pytest.mark.parametrize("chunk_experts,backwards", [(2, False), (2, True), (5, False)])
def test_fused_moe_dequantizes_int4_experts_chunk_after_chunk(chunk_experts, backwards,
                                                              monkeypatch):
    """Past DENSE_SLOTS slots an expert, fused_moe's two matrices each dequantize their experts
    in chunks of a buffer's size (5 experts: 2 + 2 + 1 or one chunk; expert 4 routed no token)
    and multiply each chunk's blocks alone: torch_ref's result, with a residual, the chunks
    also taken last first (a chunk that computed another's experts would show)."""
    g = torch.Generator().manual_seed(chunk_experts + backwards)
    experts, inter, hidden, tokens, top_k = 5, 32, 64, 40, 3
    gate_up = quantize_experts(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1, "int4")
    down = quantize_experts(torch.randn(experts, hidden, inter, generator=g) * 0.2, "int4")
    x = torch.randn(tokens, hidden, generator=g)
    residual = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.rand(tokens, experts - 1, generator=g).topk(top_k, dim=-1)
    monkeypatch.setattr(dense, "DENSE_SLOTS", 4)
    assert dense.takes(gate_up, tokens * top_k)
    per_expert = 2 * inter * hidden * 4  # (gate_up's bytes an expert in fp32)
    monkeypatch.setattr(dense, "CHUNK_BYTES", chunk_experts * per_expert)
    calls, real = [], dense.dequantize
    monkeypatch.setattr(dense, "dequantize",
                        lambda w, first, out: calls.append((first, out.shape[0]))
                        or real(w, first, out))
    if backwards:
        forwards = dense.chunks

        def chunks(w, dtype):
            bounds = [(first, last) for first, last, _ in forwards(w, dtype)]
            calls.clear()  # (only the chunks multiplied count)
            for first, last in reversed(bounds):
                out = torch.empty(last - first, *w.shape[1:], dtype=dtype, device=DEVICE)
                yield first, last, dense.dequantize(w, first, out)

        monkeypatch.setattr(dense, "chunks", chunks)
    ref = torch_ref.fused_moe(x, gate_up, down, weights, ids, residual=residual)
    got = tri.fused_moe(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)),
                        residual=residual.to(DEVICE))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    down_chunks = [(0, 4), (4, 1)] if chunk_experts == 2 else [(0, 5)]
    want = {2: [(0, 2), (2, 2), (4, 1)], 5: [(0, 5)]}[chunk_experts]
    if backwards:
        assert calls == down_chunks[::-1]  # (gate_up's cleared by down's)
    else:
        assert calls == want + down_chunks
