"""Quantized weights on the GPU: the engine with the W4A16 / W8A16 kernels (decode) and the
dequantize-then-cuBLAS path (prefill) scores like the CPU path on the same quantized weights."""

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.quant.fp8 import quantize_fp8
from frugal.quant.int4 import quantize_rtn
from tests.engine.test_fp8_kv import tiny_dir

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [100, 3] * 40]  # the last one prefills 80 rows
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


def steps(llm):
    """Per prompt, per generated token: (token, its logprob, {token: logprob} of the top 5)."""
    return [[(e.token_id, e.logprob, dict(e.top)) for e in o.outputs[0].logprobs]
            for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int4", "fp8"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.15)])
def test_quantized_gpu_scores_like_cpu(tmp_path, scheme, dtype, tol):
    """Along the CPU's greedy path (while the GPU picks the same tokens), the chosen token's
    log-probability agrees; where the two part, it is a near tie on both (a random tiny model
    has flat logits)."""
    src = str(tiny_dir(tmp_path))
    cpu = steps(LLM(src, device="cpu", dtype="float32", kv_cache_memory="16MiB",
                    quantization=scheme))
    gpu = steps(LLM(src, device="cuda", dtype=dtype, kv_cache_memory="16MiB",
                    quantization=scheme))
    compared = 0
    for want, got in zip(cpu, gpu):
        for (t_cpu, lp_cpu, top_cpu), (t_gpu, lp_gpu, _) in zip(want, got):
            if t_cpu != t_gpu:  # a near tie: the GPU's choice scores within tol on the CPU too
                assert t_gpu in top_cpu and abs(top_cpu[t_gpu] - lp_cpu) < 2 * tol
                break
            assert abs(lp_gpu - lp_cpu) < tol
            compared += 1
    assert compared >= len(PROMPTS)


@pytest.mark.gpu
def test_rounding_is_the_same_on_gpu_and_cpu():
    """The same weight gets the same codes and scales on either device (a scale of amax / 7.5
    one ulp off sends each group's largest weight across the ±7.5 rounding tie)."""
    torch.manual_seed(0)
    w = torch.randn(320, 192) * 0.05
    for symmetric in (True, False):
        for group in (32, 64):
            a, b = quantize_rtn(w, group, symmetric), quantize_rtn(w.cuda(), group, symmetric)
            assert torch.equal(a.codes(), b.codes().cpu())
            assert torch.equal(a.scales, b.scales.cpu())
    for block in (None, 64):
        a, b = quantize_fp8(w, block), quantize_fp8(w.cuda(), block)
        assert torch.equal(a.scales, b.scales.cpu())
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8).cpu())
