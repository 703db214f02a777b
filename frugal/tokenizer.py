"""Tokenizer and chat template, built from GGUF metadata or a HF `tokenizer.json`.

GGUF byte-level BPE: the `smollm` pre-tokenizer splits every digit on its own before the GPT-2
split, as llama.cpp and the original SmolLM2 `tokenizer.json` do. transformers' GGUF conversion
skips the digit split, so "a  1" (two spaces, a digit) tokenizes differently there; frugal follows
llama.cpp and the original tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

Conversation = list[dict[str, Any]]

# llama.cpp pre-tokenizer names -> extra splits before the byte-level GPT-2 regex split
_GGUF_PRE = {"default": [], "gpt2": [], "smollm": [pre_tokenizers.Digits(individual_digits=True)]}
_CONTROL, _USER_DEFINED = 3, 4


class TooManyTokens(ValueError):
    """A text of more tokens than the caller allows (a server: the context length)."""


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template.

    eos_token_ids: every id that ends generation (the EOS plus any end-of-turn ids).
    """

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, add_bos: bool) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._max_token_chars: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (a bound: the longest token's text)."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(len(t.encode("utf-8", "surrogatepass")) for t in vocab)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt",
               max_tokens: int | None = None) -> list[int]:
        """Token ids of text; a BOS is prepended when the model wants one and add_special_tokens.
        Text that is not valid Unicode (a lone surrogate) raises ValueError naming `field`, as
        does text of more than max_tokens tokens: refused unread when its length alone proves
        it (more than max_tokens * max_token_chars * 4 characters; 4 for normalizers that
        shorten text), else before its ids become a list. Releases the GIL while it tokenizes
        (encode_batch does; encode does not), so a long text tokenized on a worker thread does
        not stall the server's event loop; what a 15 MB text would cost with the GIL held (its
        ids as a list, its encoding's release) is what max_tokens spares."""
        too_long = TooManyTokens(f"{field}: more than {max_tokens} tokens, this model's "
                                 "maximum context length")
        if max_tokens is not None and len(text) > 4 * max_tokens * self.max_token_chars:
            raise too_long
        check_unicode(text, field)
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise too_long
        ids = encoding.ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Conversation,
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation ([{'role', 'content'}, ...]) with the model's template."""
        if not self.chat_template:
            raise ValueError("chat: this model has no chat template")
        if not isinstance(conversation, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
            raise ValueError("messages: must be a list of {'role': ..., 'content': ...} dicts")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent,
                                                                       ensure_ascii=False)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        special = {"bos_token": self._token_text(self.bos_token_id),
                   "eos_token": self._token_text(self.eos_token_id)}
        return self._template.render(messages=conversation,
                                     add_generation_prompt=add_generation_prompt, **special)

    def encode_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                    max_tokens: int | None = None) -> list[int]:
        """Token ids of a rendered conversation (the template writes any BOS itself)."""
        return self.encode(self.apply_chat_template(conversation, add_generation_prompt),
                           add_special_tokens=False, field="messages", max_tokens=max_tokens)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], path: str) -> Tokenizer:
        """meta: GGUF key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = meta.get("tokenizer.ggml.model")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if kind != "gpt2":
            raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (gpt2 only)")
        if pre not in _GGUF_PRE:
            raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                             f"({', '.join(_GGUF_PRE)})")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*_GGUF_PRE[pre], pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if meta.get(k) is not None]
        return cls(tok, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=list(dict.fromkeys(eos)),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    def save(self, path: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, readable by from_dir (a BOS the model
        wants becomes tokenizer.json's post-processor, as in HF directories)."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        bos = self._token_text(self.bos_token_id)
        if self.add_bos and bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.bos_token_id)])
        tok.save(str(path / "tokenizer.json"))
        config = {"bos_token": bos or None, "eos_token": self._token_text(self.eos_token_id),
                  "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def from_dir(cls, path: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """A HF model directory: tokenizer.json (+ tokenizer_config.json for the template)."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return tok.token_to_id(value) if value else None

        eos = list(eos_token_ids) or [i for i in [token_id("eos_token")] if i is not None]
        # tokenizer.json's post-processor already adds BOS where the model wants one.
        return cls(tok, bos_token_id=token_id("bos_token"), eos_token_ids=eos,
                   chat_template=template, add_bos=False)


def check_unicode(text: str, field: str) -> None:
    """Raise ValueError naming `field` when text holds a lone surrogate (JSON allows "\ud800";
    UTF-8 and the tokenizer do not)."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(f"{field}: not valid Unicode (a lone surrogate at character {at})")


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in text, if any."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")
