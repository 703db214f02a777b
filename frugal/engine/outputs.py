"""What the engine reports for a request: when a new token stops it, and its output delta."""

from __future__ import annotations

import torch

from frugal.engine.detokenizer import IncrementalDetokenizer
from frugal.request import CompletionOutput, FinishReason, Request, RequestOutput


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
