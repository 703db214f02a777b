"""Requests in, Jobs out: the checks past pydantic's, and tokenizing (in the thread pool).

One HTTP request may carry several prompts and n choices each; every (prompt, choice) becomes one
engine request, numbered index = prompt * n + choice. Whatever a client can get wrong is an
APIError here, before anything reaches the engine: a Job's prompts fit the context with room for
at least one token, and each choice's max_tokens fits in what its prompt leaves.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from frugal.engine.async_engine import AsyncEngine
from frugal.request import SamplingParams
from frugal.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    conversation,
)
from frugal.tokenizer import Tokenizer, TooManyTokens


@dataclass
class Job:
    """What one HTTP request asks of the engine. prompts[i] holds choices i*n .. i*n+n-1."""

    kind: str  # "chat" or "completion"
    id: str
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: list[SamplingParams]  # one per choice index
    n: int
    echo: bool = False
    include_usage: bool = False
    kv_transfer: dict | None = None  # kv_transfer_params (see frugal.disagg.nixl_connector)
    cache_salt: str | None = None  # prefix-cache pages are shared only under the same salt

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


class Jobs:
    """Builds the Jobs of one engine (its tokenizer and max_model_len)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    def completion(self, req: CompletionRequest) -> Job:
        req.check()
        prompts, texts = [], []
        for p in req.prompts():
            ids = self._tokenize(p)
            prompts.append(ids)
            texts.append(p if isinstance(p, str) else self._decode(ids))
        prompt_logprobs = req.logprobs if req.echo else None
        params = [req.sampling_params(self._max_tokens(ids, req.max_tokens), req.logprobs,
                                      prompt_logprobs, c)
                  for ids in prompts for c in range(req.n)]
        if req.kv_transfer and (len(prompts) > 1 or req.echo):
            raise APIError("kv_transfer_params: only with one prompt and echo false",
                           "kv_transfer_params")
        return Job("completion", f"cmpl-{uuid.uuid4().hex}", req.model, prompts, texts, params,
                   req.n, echo=req.echo, include_usage=req.include_usage,
                   kv_transfer=req.kv_transfer, cache_salt=req.cache_salt)

    def chat(self, req: ChatCompletionRequest) -> Job:
        req.check()
        ids = self._tokenize(encode_chat(self.tokenizer, conversation(req.messages),
                                         req.add_generation_prompt, self.max_model_len))
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = [req.sampling_params(self._max_tokens(ids, max_tokens), logprobs, None, c)
                  for c in range(req.n)]
        return Job("chat", f"chatcmpl-{uuid.uuid4().hex}", req.model, [ids], [""], params,
                   req.n, include_usage=req.include_usage, kv_transfer=req.kv_transfer,
                   cache_salt=req.cache_salt)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = prompt  # token ids too many for the context are refused before each is checked
        if isinstance(prompt, str) or len(prompt) < self.max_model_len:
            try:
                ids = self.engine.tokenize(prompt, self.max_model_len)
            except ValueError as e:
                raise APIError.from_value_error(e) from e
        if len(ids) >= self.max_model_len:
            raise APIError(f"prompt: {len(ids)} tokens, but this model's maximum context length "
                           f"is {self.max_model_len} tokens", "prompt",
                           code="context_length_exceeded")
        return ids

    def _max_tokens(self, prompt: list[int], max_tokens: int | None) -> int:
        room = self.max_model_len - len(prompt)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(f"max_tokens: {max_tokens} requested, but the prompt's {len(prompt)} "
                           f"tokens leave room for {room} within the maximum context length "
                           f"{self.max_model_len}", "max_tokens", code="context_length_exceeded")
        return max_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""


def encode_chat(tokenizer: Tokenizer | None, messages: list[dict[str, str]],
                add_generation_prompt: bool = True, max_tokens: int | None = None) -> list[int]:
    """Token ids of a conversation through the model's chat template; bad messages, or more
    than max_tokens tokens -> 400."""
    if tokenizer is None:
        raise APIError("messages: this model has no tokenizer", "messages")
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt, max_tokens)
    except ValueError as e:
        raise APIError(str(e), "messages", code="context_length_exceeded"
                       if isinstance(e, TooManyTokens) else None) from e
