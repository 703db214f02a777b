"""The real default model through frugal's engine vs transformers on the same GGUF (CPU, fp32)."""

import torch

from frugal.request import FinishReason, Request, SamplingParams
from tests.conftest import CHAT_PROMPTS


def frugal_logits(llm, token_ids: list[int], from_cache: bool = False) -> torch.Tensor:
    """Logits at every position, computed through the paged KV cache in one prefill step
    (from_cache: the tokens read one another's K/V from the cache, as decode steps do)."""
    engine = llm.engine
    # (scoring every prompt token: nothing comes from the prefix cache, the whole prompt is run)
    params = SamplingParams(prompt_logprobs=0, prompt_from_cache=from_cache)
    request = Request("logits", None, token_ids, params, len(token_ids) + 1)
    engine.scheduler.add(request)
    out = engine.scheduler.schedule()
    assert out.requests == [request] and out.num_new_tokens == [len(token_ids)]
    try:
        hidden = engine.runner.forward(engine.runner.prepare(out))
        with torch.inference_mode():
            return engine.runner.compute_logits(hidden)
    finally:  # (no launch took the step's tag changes to the device: the next one does)
        engine.scheduler.kv.return_tag_updates(out.tag_updates)
        engine.scheduler.finish(request, FinishReason.ABORT)



def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 logits [n, vocab] within 1e-3 of transformers' (relative, per row), argmax equal."""
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max().item() < 1e-3, rel.max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def assert_greedy_matches(llm, ref_model, prompt: list[int], max_tokens: int) -> None:
    """llm's greedy tokens after prompt are transformers' generate's (EOS ignored by both)."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))
    ref_model.generation_config.eos_token_id = None  # as ignore_eos
    with torch.inference_mode():
        want = ref_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                  do_sample=False)
    assert out[0].outputs[0].token_ids == want[0, len(prompt):].tolist()

def test_logits_match_transformers(llm, hf):
    tok, model = hf
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n",
             "In 1969, Neil Armstrong became the first person to walk on the Moon. He said"]
    for text in texts:
        ids = llm.get_tokenizer().encode(text)
        ours = frugal_logits(llm, ids)
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape == (len(ids), 49152)
        rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max().item() < 1e-3, rel
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-3
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert llm.engine.runner.pool.num_pages == llm.engine.scheduler.kv.num_free


def test_greedy_chat_matches_transformers_generate(llm, hf):
    tok, model = hf
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    ours = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=64))
    for conv, out in zip(conversations, ours):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        assert ids[0].tolist() == out.prompt_token_ids  # same template, same tokens
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                 do_sample=False, eos_token_id=2, pad_token_id=2)
        ref_tokens = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref_tokens
        assert out.outputs[0].text == tok.decode(ref_tokens, skip_special_tokens=True)
    assert "Paris" in ours[0].outputs[0].text
