"""The hand-off on a GPU: NIXL VRAM reads between two engines at the Llama-3.1-8B shape (first
layers, random weights). bf16 on both sides decodes as the co-located engine does; an FP8
prefill and an INT4 decode worker (what disaggregation is for) hand over intact pages."""

import pytest
import torch

from frugal.config import CacheConfig, EngineConfig
from frugal.engine.llm_engine import LLMEngine
from frugal.request import SamplingParams
from tests.disagg.engines import SECRET, drain, prefill, settle

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl_cu13")

PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((7, 16, 33, 700, 4000))]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="llama-3.1-8b", load_format="dummy",
                                  dummy_init="normal", num_layers=4,
                                  device="cuda", cache=CacheConfig(kv_cache_memory="4GiB"),
                                  **kw))


@pytest.mark.parametrize("weights", [("none", "none"), ("fp8", "int4")],
                         ids=["bf16-bf16", "fp8-int4"])
def test_vram_handoff(weights):
    assert torch.cuda.is_available()
    p = engine(kv_role="prefill", quantization=weights[0], kv_secret=SECRET,
               kv_address=("127.0.0.1", 1))
    d = engine(kv_role="decode", quantization=weights[1], kv_secret=SECRET)
    params = prefill(p, PROMPTS, GREEDY)
    for i, prompt in enumerate(PROMPTS):
        d.add_request(prompt, GREEDY, f"d{i}", params[f"p{i}"])
    out = drain(d, p)
    assert all(o.outputs[0].finish_reason == "length" for o in out.values()), out
    assert d.stats().num_kv_loads == len(PROMPTS) and d.stats().num_kv_load_failures == 0
    if weights == ("none", "none"):
        c = engine()
        for i, prompt in enumerate(PROMPTS):
            c.add_request(prompt, GREEDY, f"c{i}")
        ref = drain(c)
        # random weights in bf16 give near ties, and the batches differ from the co-located
        # engine's: the first token read through the transferred pages is what must agree
        for i in range(len(PROMPTS)):
            assert out[f"d{i}"].outputs[0].token_ids[:2] == ref[f"c{i}"].outputs[0].token_ids[:2]
    settle(p, d)
