"""The GGUF tokenizer and chat template against transformers and llama.cpp's digit rule."""

import pytest

from tests.conftest import CHAT_PROMPTS

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 12345 apples cost $3.50.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Unicode: naïve café, 日本語, emoji 🙂👍🏽, Ελληνικά.",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(llm, hf, text):
    tok, _ = hf
    assert llm.get_tokenizer().encode(text) == tok(text).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(llm, text):
    t = llm.get_tokenizer()
    assert t.decode(t.encode(text), skip_special_tokens=False) == text


def test_digits_split_as_llama_cpp_does(llm, hf):
    """smollm pre-tokenizer: each digit alone, so two spaces stay one 'ĠĠ' token before a digit.

    transformers' GGUF conversion drops the digit split and gives 'Ġ', 'Ġ3' -> 'Ġ', 'Ġ', '3'.
    """
    t = llm.get_tokenizer()
    ids = t.encode("12  3")
    assert [t.id_to_token(i) for i in ids] == ["1", "2", "ĠĠ", "3"]
    tok, _ = hf
    assert tok("12  3").input_ids != ids  # the documented difference, still there


def test_special_tokens_and_ids(llm):
    t = llm.get_tokenizer()
    assert t.bos_token_id == 1 and t.eos_token_ids == [2]
    assert t.encode("<|im_end|>") == [2]
    assert t.decode([1, 28120, 2]) == t.decode([28120])  # specials skipped by default


def test_chat_template_matches_transformers(llm, hf):
    tok, _ = hf
    t = llm.get_tokenizer()
    for prompt in CHAT_PROMPTS:
        conv = [{"role": "user", "content": prompt}]
        ours = t.apply_chat_template(conv)
        assert ours == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert ours.endswith("<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert t.apply_chat_template(with_system) == tok.apply_chat_template(
        with_system, add_generation_prompt=True, tokenize=False)


def test_chat_template_rejects_bad_messages(llm):
    with pytest.raises(ValueError, match="messages"):
        llm.get_tokenizer().apply_chat_template([{"content": "no role"}])
