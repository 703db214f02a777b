"""The GPU path (Triton ops, CUDA graphs, pool sized from gpu_memory_utilization) against the CPU
path on the real default model."""

import pytest
import torch

from frugal import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.models.test_llama_vs_hf import frugal_logits

pytestmark = pytest.mark.gpu

PROMPTS = CHAT_PROMPTS + [
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Give one tip for writing clear code.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def cpu_tokens(llm):
    return _tokens(llm)


def test_gpu_fp32_greedy_equals_cpu(llm, cpu_tokens):
    gpu = LLM(dtype="float32", device="cuda", kv_cache_memory="1GiB")
    assert gpu.engine.runner.graphs is not None
    assert _tokens(gpu) == cpu_tokens


def test_cuda_graphs_equal_eager():
    kwargs = dict(dtype="float32", device="cuda", kv_cache_memory="1GiB", max_num_seqs=16)
    graphs, eager = LLM(**kwargs), LLM(enforce_eager=True, **kwargs)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    # 8 prompts decode in a padded graph of 8, then 5 (padded to 8) as the short ones finish
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    ours = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    runner = graphs.engine.runner
    assert runner.pool.num_pages == graphs.engine.scheduler.kv.num_free


def test_prompt_graphs_equal_eager():
    """Steps with prompt tokens (chunks of 64 alone and beside decodes, the short prompts' last
    chunks) replayed from padded graphs: the eager engine's tokens, no page leaked."""
    from frugal.config import CacheConfig, EngineConfig, SchedulerConfig

    def engine(**kwargs):
        return LLM.from_config(EngineConfig(
            dtype="float32", device="cuda", cache=CacheConfig(kv_cache_memory="1GiB"),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64), **kwargs))

    graphs, eager = engine(prompt_graph_max_tokens=64), engine(enforce_eager=True)
    runner = graphs.engine.runner
    assert runner.prompt_graphs is not None and eager.engine.runner.prompt_graphs is None
    replays = []
    run = runner.prompt_graphs.run
    runner.prompt_graphs.run = lambda inputs: replays.append(1) or run(inputs)
    prompts = [p * (1 + i % 3) for i, p in enumerate(PROMPTS)]  # 64-token chunks, and short
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert len(replays) >= 2
    assert runner.pool.num_pages == graphs.engine.scheduler.kv.num_free


def test_gpu_bf16_differs_only_within_rounding(llm, cpu_tokens):
    """Where bf16 greedy leaves the fp32 path, the fp32 logits of the two tokens are close."""
    gpu = LLM(dtype="bfloat16", device="cuda", kv_cache_memory="1GiB")
    tokenizer = llm.get_tokenizer()
    margins = []
    for prompt, ours, ref in zip(PROMPTS, _tokens(gpu), cpu_tokens):
        diverge = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diverge is None:
            continue
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) + ref[:diverge]
        logits = frugal_logits(llm, ids)[-1]
        margins.append((logits[ref[diverge]] - logits[ours[diverge]]).item()
                       / logits.abs().max().item())
    assert all(0 <= m < 0.02 for m in margins), margins


@pytest.mark.gpu_alone
def test_gpu_memory_utilization_sizes_the_pool():
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3)
    pool = llm.engine.runner.pool
    assert 0.2 * total < pool.num_bytes < 0.3 * total
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.001)
