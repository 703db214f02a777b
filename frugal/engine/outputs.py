"""A request's way in and out of the engine: its prompt's token ids, checked; when a new token
stops it; what is new in its output."""

from __future__ import annotations

import torch

from frugal.engine.detokenizer import IncrementalDetokenizer
from frugal.request import CompletionOutput, FinishReason, Request, RequestOutput, SamplingParams
from frugal.tokenizer import Tokenizer


def is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def prompt_token_ids(prompt: str | list[int], tokenizer: Tokenizer | None,
                     vocab_size: int, max_tokens: int | None = None) -> list[int]:
    """The token ids of a prompt (text, or token ids checked against the vocabulary); ValueError
    naming what is wrong (a text of more than max_tokens tokens too: Tokenizer.encode)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return tokenizer.encode(prompt, max_tokens=max_tokens)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt: expected text or a list of token ids, got "
                         f"{type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt: must not be empty")
    for t in prompt:
        if not is_token_id(t, vocab_size):
            raise ValueError(f"prompt: token id {t!r} is not in [0, {vocab_size})")
    return list(prompt)


def new_request(prompt: str | list[int], token_ids: list[int], params: SamplingParams,
                request_id: str, max_model_len: int, vocab_size: int,
                cache_salt: str | None) -> Request:
    """A request of validated prompt token_ids; ValueError naming what else is wrong."""
    bad = [t for t in params.stop_token_ids if not is_token_id(t, vocab_size)]
    if bad:
        raise ValueError(f"stop_token_ids: {bad[0]!r} is not a token id in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                         f"max_model_len {max_model_len}")
    max_total = max_model_len
    if params.max_tokens is not None:
        max_total = min(max_total, len(token_ids) + params.max_tokens)
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
    return Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
                   max_total, cache_salt=cache_salt)


def check_stop(request: Request, token: int, detok: IncrementalDetokenizer | None,
               eos_token_ids: set[int]) -> FinishReason | None:
    """Why the request stops at its newest token `token` (already in output_token_ids), or
    None; a stop string or stop token is recorded in request.stop_reason."""
    params = request.params
    delta = detok.update(request.output_token_ids) if detok is not None else ""
    if len(request.output_token_ids) >= params.min_tokens:
        if params.stop and delta:
            stop = detok.find_stop(len(delta))
            if stop is not None:
                request.stop_reason = stop
                return FinishReason.STOP
        if not params.ignore_eos and token in eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            request.stop_reason = token
            return FinishReason.STOP
    if request.num_tokens >= request.max_total_tokens:
        return FinishReason.LENGTH
    return None


def delta_output(request: Request, detok: IncrementalDetokenizer | None) -> RequestOutput:
    """What is new for the request since its previous output (see CompletionOutput); prompt
    scores once, when all are recorded."""
    text = detok.take(final=request.finished) if detok is not None else ""
    params, sent = request.params, request.num_sent
    request.num_sent = len(request.output_token_ids)
    completion = CompletionOutput(
        0, text, request.output_token_ids[sent:],
        str(request.finish_reason) if request.finished else None, request.stop_reason,
        request.logprobs[sent:] if params.logprobs is not None else None, request.error)
    prompt_logprobs = prompt_tensor = None
    if (not request.prompt_scores_sent
            and request.num_prompt_scored == request.num_prompt_tokens - 1):
        request.prompt_scores_sent = True
        if params.prompt_logprobs is not None:
            prompt_logprobs = request.prompt_logprobs
        if params.prompt_logprobs_tensor and request.prompt_logprobs_rows:
            prompt_tensor = torch.cat(request.prompt_logprobs_rows)
        request.prompt_logprobs, request.prompt_logprobs_rows = [None], []
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                         [completion], request.finished, prompt_logprobs, prompt_tensor)
