"""Scoring through the engine: small real runs (deterministic, sane), paired statistics,
KL divergence of a configuration against itself and against a damaged copy."""

import math

import pytest
import torch

from frugal import LLM
from frugal.eval import multiple_choice as mc
from frugal.eval.data import load_task, wiki_text
from frugal.eval.perplexity import perplexity, windows


@pytest.fixture(scope="module")
def items():
    return load_task("piqa", 20).items + load_task("siqa", 20).items


def test_small_multiple_choice_run_is_sane_and_deterministic(llm, items):
    tok = llm.get_tokenizer()
    first = mc.score_items(items, tok, mc.engine_scorer(llm), batch=16)
    again = mc.score_items(items, tok, mc.engine_scorer(llm), batch=7)
    # batches of other sizes: the same scores up to fp32 matmul blocking
    flat = [ll for s in first for ll in s.lls]
    assert flat == pytest.approx([ll for s in again for ll in s.lls], abs=1e-3)
    assert all(ll < 0 for s in first for ll in s.lls)
    table = {t.task: t for t in mc.task_scores(first)}
    assert table["piqa"].num_items == 20 and table["siqa"].num_items == 20
    assert 45 <= table["piqa"].acc <= 90  # a probe saw ~62 %; chance is 50 %
    assert 0 < table["siqa"].acc_stderr < 15
    assert [s.pred for s in first] == [s.pred for s in again]
    # the same batches over the same prefix cache: bit-identical (a first run, its prompts not
    # cached yet, computes them in other chunks, so it agrees only up to rounding)
    some = items[:8] + items[20:28]
    third = mc.score_items(some, tok, mc.engine_scorer(llm), batch=16)
    assert third == mc.score_items(some, tok, mc.engine_scorer(llm), batch=16)


def test_engine_scores_equal_transformers(llm, hf, items):
    _, model = hf

    def hf_scorer(sequences, context_lens):
        out = []
        with torch.inference_mode():
            for s, ctx in zip(sequences, context_lens):
                lp = model(torch.tensor([s])).logits[0].float().log_softmax(-1)
                out.append(lp[ctx - 1:len(s) - 1].gather(1, torch.tensor(s[ctx:])[:, None])
                           .sum().item())
        return out

    tok = llm.get_tokenizer()
    ours = mc.score_items(items[:10], tok, mc.engine_scorer(llm))
    theirs = mc.score_items(items[:10], tok, hf_scorer)
    for a, b in zip(ours, theirs):
        assert a.lls == pytest.approx(b.lls, abs=2e-3)


def test_paired_statistics():
    def score(task, index, right):
        return mc.ItemScore(task, index, 0, [0.0, -1.0] if right else [-1.0, 0.0], [1, 1])

    variant = [score("t", i, right) for i, right in enumerate([1, 1, 0, 1, 0, 1, 1, 1])]
    reference = [score("t", i, right) for i, right in enumerate([1, 0, 0, 1, 1, 1, 1, 1])]
    (p,) = mc.paired_scores(variant, reference)
    assert p.gained == 1 and p.lost == 1 and p.diff == 0.0 and p.num_items == 8
    diffs = [0, 1, 0, 0, -1, 0, 0, 0]
    stderr = math.sqrt(sum(d * d for d in diffs) / 7 / 8)
    assert p.ci_high == pytest.approx(100 * 1.96 * stderr)
    with pytest.raises(ValueError, match="no reference score"):
        mc.paired_scores(variant, reference[:4])


def test_item_scores_round_trip(tmp_path):
    scores = [mc.ItemScore("piqa", 3, 1, [-2.5, -1.25], [10, 12])]
    mc.save_items(str(tmp_path / "ref.json"), scores, "float32")
    assert mc.load_items(str(tmp_path / "ref.json")) == scores
    with pytest.raises(ValueError, match="reference-items"):
        mc.load_items(str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def wins(llm):
    return windows(llm.get_tokenizer().encode(wiki_text()), 128, 2)


def test_no_window_is_a_clear_error():
    with pytest.raises(ValueError, match="windows"):
        windows(list(range(100)), 512, None)
    with pytest.raises(ValueError, match="windows"):
        windows(list(range(2000)), 512, 0)


def test_kld_against_itself_is_zero(llm, wins):
    s = perplexity(llm, wins, reference=llm)
    assert s.num_tokens == 2 * 127
    assert s.kld_mean == 0.0 and s.kld_max == 0.0 and s.top1_agree_pct == 100.0
    assert s.ppl == s.ref_ppl and 5 < s.ppl < 200 and s.rms_dp_pct == 0.0


def test_perplexity_matches_transformers(llm, hf, wins):
    _, model = hf
    nll = 0.0
    with torch.inference_mode():
        for w in wins:
            lp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            nll -= lp[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum().item()
    assert perplexity(llm, wins).ppl == pytest.approx(math.exp(nll / (2 * 127)), rel=1e-4)


def test_damaged_weights_give_a_clearly_larger_kld(llm, wins):
    damaged = LLM(dtype="float32", device="cpu", kv_cache_memory="64MiB")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in damaged.engine.runner.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2 * p.std())
    s = perplexity(damaged, wins, reference=llm)
    assert s.kld_mean > 0.05 and s.top1_agree_pct < 95
    assert s.ppl > s.ref_ppl
