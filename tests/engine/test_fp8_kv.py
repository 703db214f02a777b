"""FP8 KV cache end to end on CPU: where scales come from, capacity, accuracy against fp32 KV."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from frugal import LLM, SamplingParams
from frugal.cli.main import main as cli
from frugal.config import CacheConfig
from frugal.eval import multiple_choice as mc
from frugal.eval.data import load_task, wiki_text
from frugal.eval.perplexity import perplexity, windows
from frugal.worker.kv_scales import FORMAT, TEXTS
from tests.models.test_llama_vs_hf import frugal_logits

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_dir(path, scales: dict | None = None):
    """A random 2-layer Llama (2 KV heads) as an HF directory, plus extra checkpoint tensors."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    model.save_pretrained(path)
    if scales:
        weights = load_file(path / "model.safetensors")
        save_file({**weights, **scales}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_config_names_fp8_and_rejects_misuse():
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").fp8
    with pytest.raises(ValueError, match="kv_cache_dtype: unsupported 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="only with kv_cache_dtype fp8_e4m3"):
        CacheConfig(kv_scales_path="scales.json")


def test_checkpoint_scales_per_head_and_per_tensor(tmp_path):
    """compressed-tensors names (self_attn.k_scale, per head here) and ModelOpt's
    (self_attn.k_proj.k_scale, one value) are both read; nothing is calibrated."""
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor([0.02, 0.03]),
              "model.layers.0.self_attn.v_scale": torch.tensor([0.01, 0.04]),
              "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.05),
              "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(0.06)}
    llm = LLM(str(tiny_dir(tmp_path, scales)), device="cpu", kv_cache_dtype="fp8",
              kv_cache_memory="8MiB")
    pool = llm.engine.runner.pool
    assert pool.dtype == torch.float8_e4m3fn and pool.scales_source == "checkpoint"
    want = torch.tensor([[[0.02, 0.03], [0.01, 0.04]], [[0.05, 0.05], [0.06, 0.06]]])
    torch.testing.assert_close(pool.scales, want)
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_checkpoint_missing_a_layer_scale_is_named(tmp_path):
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.02),
              "model.layers.0.self_attn.v_scale": torch.tensor(0.02)}
    with pytest.raises(ValueError, match="layer 1 has no k_scale"):
        LLM(str(tiny_dir(tmp_path, scales)), device="cpu", kv_cache_dtype="fp8",
            kv_cache_memory="8MiB")


def test_calibrate_kv_file_round_trip_and_errors(tmp_path):
    model = str(tiny_dir(tmp_path / "m"))
    out = tmp_path / "scales.json"
    assert cli(["calibrate-kv", model, "--device", "cpu", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and len(data["k_scale"]) == 2 and len(data["v_scale"][0]) == 2
    llm = LLM(model, device="cpu", kv_cache_dtype="fp8", kv_cache_memory="8MiB",
              kv_scales_path=str(out))
    pool = llm.engine.runner.pool
    assert pool.scales_source.startswith(f"file {out} (calibrated on {len(TEXTS)} built-in")
    torch.testing.assert_close(pool.scales[:, 0].cpu(), torch.tensor(data["k_scale"]))
    bad = tmp_path / "bad.json"
    for content, message in [({**data, "k_scale": data["k_scale"][:1]}, "shape"),
                             ({**data, "v_scale": [[0.0, 1.0]] * 2}, "finite and > 0"),
                             ({"k_scale": []}, "is not a frugal-kv-scales")]:
        bad.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=message):
            LLM(model, device="cpu", kv_cache_dtype="fp8", kv_cache_memory="8MiB",
                kv_scales_path=str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        LLM(model, device="cpu", kv_cache_dtype="fp8", kv_scales_path=str(tmp_path / "none"))


def test_fp8_holds_twice_the_tokens_of_bf16(tmp_path):
    model = str(tiny_dir(tmp_path))
    bf16 = LLM(model, device="cpu", dtype="bfloat16", kv_cache_memory="16MiB")
    fp8 = LLM(model, device="cpu", dtype="bfloat16", kv_cache_memory="16MiB",
              kv_cache_dtype="fp8")
    ratio = fp8.engine.runner.pool.capacity_tokens / bf16.engine.runner.pool.capacity_tokens
    assert ratio >= 1.95 and fp8.engine.worker.kv_capacity_ratio == 2.0


def test_startup_calibration_sets_real_scales(fp8_llm):
    pool = fp8_llm.engine.runner.pool
    assert pool.scales_source.startswith(f"start-up: calibrated on {len(TEXTS)} built-in")
    scales = pool.scales
    assert scales.shape == (30, 2, 3) and bool((scales > 0).all())
    assert not bool(torch.isclose(scales, torch.ones_like(scales)).any())  # never a silent 1.0


def test_fp8_eval_slice_against_fp32_kv(llm, fp8_llm):
    """The CI slice of the accuracy check (the full sets are in docs/accuracy.md): paired
    multiple choice on 40 items and perplexity / KL divergence on two Wikipedia windows."""
    tok = llm.get_tokenizer()
    items = load_task("piqa", 20).items + load_task("siqa", 20).items
    ref = mc.score_items(items, tok, mc.engine_scorer(llm), batch=20)
    got = mc.score_items(items, tok, mc.engine_scorer(fp8_llm), batch=20)
    assert sum(a.pred != b.pred for a, b in zip(ref, got)) <= 2
    s = perplexity(fp8_llm, windows(tok.encode(wiki_text()), 128, 2), reference=llm)
    assert s.kld_mean < 0.02 and s.top1_agree_pct >= 90 and abs(s.ppl / s.ref_ppl - 1) < 0.03


@pytest.mark.parametrize("content", ["", "calibrate on this"])
def test_calibration_file(tmp_path, content):
    """--calibration-file: the text's tokens set the scales; an empty file is refused."""
    text = tmp_path / "calib.txt"
    text.write_text(content * 40)
    if not content:
        with pytest.raises(ValueError, match="holds no text"):
            LLM(device="cpu", kv_cache_dtype="fp8", kv_cache_memory="64MiB",
                calibration_file=str(text))
        return
    llm = LLM(device="cpu", kv_cache_dtype="fp8", kv_cache_memory="64MiB",
              calibration_file=str(text))
    assert llm.engine.runner.pool.scales_source.startswith("start-up: calibrated on ")
    assert str(text) in llm.engine.runner.pool.scales_source


def test_fp8_logits_stay_close_to_fp32_kv(llm, fp8_llm):
    """Next-token distributions over real text read through the FP8 cache (as decode steps
    read it): small KL divergence, same top-1 nearly always. Read in one prompt step, the
    text's own K/V are taken as computed: the fp32 cache's distributions, up to float error."""
    tok = llm.get_tokenizer()
    text = ("The history of the printing press begins in the fifteenth century, when Johannes "
            "Gutenberg combined movable metal type with an oil-based ink and a screw press. "
            "Books became cheaper, and ideas travelled faster than ever before across Europe.")
    ids = tok.encode(text)
    ref = frugal_logits(llm, ids).float().log_softmax(-1)
    got = frugal_logits(fp8_llm, ids, from_cache=True).float().log_softmax(-1)
    kld = (ref.exp() * (ref - got)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert 1e-5 < kld.mean().item() < 0.02 and agree >= 0.9, (kld.mean().item(), agree)
    fresh = frugal_logits(fp8_llm, ids).float().log_softmax(-1)
    assert (ref.exp() * (ref - fresh)).sum(-1).abs().max().item() < 1e-6


@pytest.mark.gpu
def test_fp8_on_gpu_graphs_equal_eager_and_stay_close_to_bf16(tmp_path):
    """The Triton path (fused quantizing store, FP8 decode and extend kernels, CUDA graphs) on a
    tiny random Llama: graphs give the eager tokens; logits stay near a bf16 cache's."""
    model = str(tiny_dir(tmp_path))
    common = dict(device="cuda", dtype="bfloat16", kv_cache_memory="64MiB")
    fp8 = LLM(model, kv_cache_dtype="fp8", **common)
    eager = LLM(model, kv_cache_dtype="fp8", enforce_eager=True, **common)
    bf16 = LLM(model, **common)
    assert fp8.engine.runner.graphs is not None
    prompts = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphed = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    assert graphed == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    ref = frugal_logits(bf16, prompts[2]).float().log_softmax(-1)
    got = frugal_logits(fp8, prompts[2]).float().log_softmax(-1)
    assert (ref.exp() * (ref - got)).sum(-1).mean().item() < 0.02
