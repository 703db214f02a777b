"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Types are checked by pydantic (the field types: see fields); ranges by SamplingParams. Fields
OpenAI clients send that frugal does not implement are accepted when left at their neutral value
and refused otherwise, so a request never silently means something else.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frugal.disagg import wants_transfer
from frugal.request import SamplingParams
from frugal.server.fields import Prompt, Text, TokenIds, at_most
from frugal.tokenizer import TooManyTokens, lone_surrogate

MAX_N = 64
MAX_STOP = 16  # stop strings in one request
# Characters in all of a request's stop strings: every step of the request looks for each of them
# in its recent text (engine.detokenizer), and 16 stop strings of 1 MB made other requests 1.9x
# slower.
MAX_STOP_CHARS = 4096


# Unknown fields are ignored (clients send many); known ones take their own JSON type only
# (no "1" for 1, no false for 0), so a request never quietly means something else.
_STRICT = ConfigDict(extra="ignore", strict=True)


class APIError(Exception):
    """An error the client caused (or, with a 5xx status, the server): an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (message, param, status,
                                                                        code, kind)

    @classmethod
    def from_value_error(cls, e: ValueError) -> APIError:
        """'field: what is wrong' -> a 400 naming the field."""
        text = str(e)
        field = text.split(":", 1)[0] if ":" in text else None
        return cls(text, param=field if field and field.isidentifier() else None,
                   code="context_length_exceeded" if isinstance(e, TooManyTokens) else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer (as OpenAI sends it)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what} for status, what in (
        (400, "Invalid request: `error.param` names the field"),
        (401, "Missing or wrong API key"), (404, "Unknown model"),
        (413, "Body over --max-request-bytes"), (429, "Queue full (--max-queued-requests)"),
        (500, "The engine failed this request"), (503, "The engine is not running"))}


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Common(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI names, vLLM extras)."""

    model_config = _STRICT

    model: Text
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP), at_most(MAX_STOP)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # extras, as vLLM and SGLang accept them
    top_k: int = -1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # prefill/decode disaggregation, as vLLM's NixlConnector and vllm-router speak it
    kv_transfer_params: dict[str, Any] | None = None  # its values: check_json_values
    # prefix caching: requests share cached KV pages only when their salts are equal (vLLM's)
    cache_salt: Text | None = None

    def check_common(self) -> None:
        """Checks past what pydantic does on the event loop: these run in the thread pool."""
        if self.kv_transfer_params is not None:
            check_json_values(self.kv_transfer_params, "kv_transfer_params")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if (num_chars := sum(map(len, stops))) > MAX_STOP_CHARS:
            raise APIError(f"stop: {num_chars} characters in all, at most {MAX_STOP_CHARS}",
                           "stop")
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n: must be in [1, {MAX_N}], got {self.n}", "n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(f"{name}: not supported (only 0)", name)
        if self.logit_bias:
            raise APIError("logit_bias: not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed with stream=true", "stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise APIError("cache_salt: must be a non-empty string", "cache_salt")
        if self.kv_transfer and self.n != 1:
            raise APIError("n: must be 1 with kv_transfer_params", "n")

    @property
    def kv_transfer(self) -> dict | None:
        """kv_transfer_params when they ask for a transfer (see disagg.wants_transfer)."""
        p = self.kv_transfer_params
        return p if wants_transfer(p) else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None, choice: int) -> SamplingParams:
        """Choice i of n gets seed + i, so n seeded choices differ and each is reproducible."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
                min_tokens=self.min_tokens, seed=None if self.seed is None else self.seed + choice,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise APIError.from_value_error(e) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError("prompt: must not be empty", "prompt")
        return list(p)  # at most MAX_PROMPTS (see Prompt)

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, self.n):
            raise APIError("best_of: not supported (only equal to n)", "best_of")
        if self.suffix:
            raise APIError("suffix: not supported", "suffix")


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        self.check_common()
        if self.tools:
            raise APIError("tools: tool calling is not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError("response_format: only 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", "top_logprobs")


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them ('developer' is OpenAI's new name for 'system')."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    tokens: TokenIds


def check_json_values(value: Any, field: str) -> None:
    """A 400 naming `field` for a lone surrogate in any string (keys included) or a NaN or
    infinite number anywhere in a JSON value: neither can be sent on (JSON has no NaN, UTF-8
    no lone surrogates), so they would fail later as a 500. Iterative: the nesting is as deep
    as json.loads allowed, which a recursion here might not be."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and lone_surrogate(v) is not None:
            raise APIError(f"{field}: not valid Unicode (a lone surrogate)", field)
        if isinstance(v, float) and not math.isfinite(v):
            raise APIError(f"{field}: {v} is not a JSON number", field)
        if isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
