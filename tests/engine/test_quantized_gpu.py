"""Quantized weights on the GPU: the W4A16 / W8A16 kernels in the engine give the CPU path's
greedy output (fp32, where both multiply exactly) and run in bf16."""

import pytest

from frugal import LLM, SamplingParams
from tests.engine.test_fp8_kv import tiny_dir

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [100, 3]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_quantized_gpu_equals_cpu(tmp_path, scheme):
    src = str(tiny_dir(tmp_path))
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(src, device=device, dtype="float32", kv_cache_memory="16MiB",
                  quantization=scheme)
        outputs[device] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert outputs["cuda"] == outputs["cpu"]
    llm = LLM(src, device="cuda", dtype="bfloat16", kv_cache_memory="16MiB",
              quantization=scheme)
    bf16 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert all(len(t) == 8 for t in bf16)
    assert sum(a[0] == b[0] for a, b in zip(bf16, outputs["cpu"])) >= 2
