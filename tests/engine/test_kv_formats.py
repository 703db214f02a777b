"""KV cache formats with a scale in each row (fp8_per_token_head, int8_per_token_head, fp8_v) end
to end on CPU, and the start-up check every quantized format gets."""

import logging

import pytest
import torch

from frugal import LLM, SamplingParams
from frugal.config import CacheConfig, ModelConfig
from frugal.worker.kv_pool import KVPool
from frugal.worker.kv_spec import KVSpec
from tests.engine.test_fp8_kv import tiny_dir

ROW_FORMATS = ["fp8_per_token_head", "int8_per_token_head", "fp8_v"]


def test_config_names_formats_and_checks_the_kl_bound():
    assert CacheConfig(kv_cache_dtype="int8_per_token").kv_cache_dtype == "int8_per_token_head"
    assert CacheConfig(kv_cache_dtype="fp8_v").quantized
    assert not CacheConfig(kv_cache_dtype="fp8_per_token_head").fp8  # (no static scales)
    with pytest.raises(ValueError, match="kv_cache_max_kl"):
        CacheConfig(kv_cache_max_kl=0.01)  # a bf16 cache has nothing to check
    with pytest.raises(ValueError, match="kv_cache_max_kl"):
        CacheConfig(kv_cache_dtype="fp8_v", kv_cache_max_kl=-1.0)
    with pytest.raises(ValueError, match="kv_cache_max_kl: needs the start-up check"):
        CacheConfig(kv_cache_dtype="fp8_v", kv_cache_max_kl=0.01, kv_cache_check=False)


def llama(head_dim: int = 128, mla: bool = False) -> ModelConfig:
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=4096,
              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, head_dim=head_dim, max_position_embeddings=8192)
    if mla:
        hf.update(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512, q_lora_rank=None,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    return ModelConfig.from_hf(hf)


def test_row_formats_hold_nearly_twice_the_tokens_of_bf16():
    """Llama-3.1-8B's shape: 128 + 4 bytes a row against 256 (1.94x); fp8_v's K stays bf16."""
    mc = llama()
    bf16 = KVSpec.of(mc, CacheConfig(), torch.bfloat16).page_bytes
    ratios = {f: bf16 / KVSpec.of(mc, CacheConfig(kv_cache_dtype=f), torch.bfloat16).page_bytes
              for f in ROW_FORMATS}
    assert ratios["fp8_per_token_head"] == ratios["int8_per_token_head"] == 512 / 264
    assert ratios["fp8_v"] == 512 / (256 + 132)
    with pytest.raises(ValueError, match="MLA"):
        KVSpec.of(llama(mla=True), CacheConfig(kv_cache_dtype="fp8_v"), torch.bfloat16)
    with pytest.raises(ValueError, match="divisible by 4"):
        KVSpec.of(llama(head_dim=66), CacheConfig(kv_cache_dtype="int8_per_token"),
                  torch.bfloat16)


def test_fp8_v_pool_views_k_and_v_in_one_row():
    """K in the activation dtype and V's e4m3 row share each (slot, head) row of the pool: what
    one writes, the other does not see, and a page stays one run of bytes per layer."""
    spec = KVSpec.of(llama(head_dim=16), CacheConfig(kv_cache_dtype="fp8_v", page_size=4),
                     torch.bfloat16)
    pool = spec.pool(3, "cpu")
    assert isinstance(pool, KVPool) and pool.storage.shape[1] == 1
    assert pool.k[0].shape == (3, 4, 8, 16) and pool.k[0].dtype == torch.bfloat16
    assert pool.v[0].shape == (3, 4, 8, 20) and pool.v[0].dtype == torch.float8_e4m3fn
    pool.k[1].fill_(1.0)
    assert pool.v[1].view(torch.uint8).eq(0).all() and pool.k[0].eq(0).all()
    assert pool.describe() == {"kv_cache_dtype": "fp8_v (K bfloat16)",
                               "kv_scales": "per token and head, in each row"}


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_row_formats_generate_with_prefix_hits_and_pages_copied_between_pools(tmp_path, fmt):
    """A tiny model: greedy tokens with a prefix-cache hit equal those without; a page copied
    as a KV transfer moves it (num_layers x parts chunks of chunk_bytes at the offsets NIXL's
    descriptors name) carries every layer's K, V and their scales."""
    model = str(tiny_dir(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(3, 40))
    cold = LLM(model, device="cpu", kv_cache_dtype=fmt, kv_cache_memory="8MiB",
               enable_prefix_caching=False)
    want = cold.generate([prompt], params)[0].outputs[0].token_ids
    warm = LLM(model, device="cpu", kv_cache_dtype=fmt, kv_cache_memory="8MiB")
    warm.generate([prompt[:33]], params)  # two full pages of 16 cached
    assert warm.generate([prompt], params)[0].outputs[0].token_ids == want
    assert warm.engine.scheduler.kv.num_cache_hits >= 32
    src, dst = cold.engine.worker.pool, warm.engine.worker.pool
    size, chunks = src.chunk_bytes, src.storage.shape[0] * src.storage.shape[1]
    src_bytes, dst_bytes = (p.storage.view(-1).view(torch.uint8) for p in (src, dst))
    pages = [0, 2, 3]
    for c in range(chunks):
        for p in pages:
            at_src, at_dst = ((c * pool.num_pages + p) * size for pool in (src, dst))
            dst_bytes[at_dst:at_dst + size] = src_bytes[at_src:at_src + size]
    assert dst.checksums(pages) == src.checksums(pages)
    for layer in range(len(src.k)):
        for a, b in ((src.k[layer], dst.k[layer]), (src.v[layer], dst.v[layer])):
            assert torch.equal(a[pages].view(torch.uint8), b[pages].view(torch.uint8))
            assert a[pages].view(torch.uint8).any()  # (written: the copy moved something)
    stats = warm.engine.stats()
    assert stats.kv_cache["kv_cache_dtype"].startswith(fmt) and stats.kv_check_kl is not None


def test_startup_check_measures_warns_and_refuses(caplog):
    """The default model: e4m3 per token and head changes answers (KL above the warning line;
    the check names a format with more bits), int8 per token and head much less;
    --kv-cache-max-kl below the measured KL refuses to start, naming it."""
    with caplog.at_level(logging.INFO, logger="frugal"):
        fp8 = LLM(device="cpu", kv_cache_dtype="fp8_per_token_head", kv_cache_memory="64MiB")
    check = fp8.engine.worker.kv_check
    assert check.format == "fp8_per_token_head" and check.num_tokens > 200
    assert 0.003 < check.kl_mean < 0.02 and 0.9 < check.top1_agree < 1.0
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("sensitive to fp8_per_token_head" in m and "try --kv-cache-dtype" in m
               for m in warning)
    with pytest.raises(ValueError, match="kv_cache_max_kl: int8_per_token_head: mean KL"):
        LLM(device="cpu", kv_cache_dtype="int8_per_token_head", kv_cache_memory="64MiB",
            kv_cache_max_kl=1e-6)
    skipped = LLM(device="cpu", kv_cache_dtype="int8_per_token_head", kv_cache_memory="64MiB",
                  kv_cache_check=False)
    assert skipped.engine.worker.kv_check is None
    assert skipped.engine.stats().kv_check_kl is None
