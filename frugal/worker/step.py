"""What a step is between launch and finish (Launched), what it produced (StepResult), and the
prompt scores some requests ask for (PromptScores: lm-evaluation-harness's echo + logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from frugal.core.scheduler import SchedulerOutput
from frugal.request import Request, TokenLogprob
from frugal.worker.sampler import token_logprobs
from frugal.worker.step_inputs import StepInputs

LOGITS_ROWS = 256  # prompt positions scored per LM-head call (bounds [rows, vocab] memory)


@dataclass
class StepResult:
    """What one step produced. sampled[i] indexes SchedulerOutput.requests and got tokens[i];
    logprobs and prompt_logprobs are keyed by position in sampled and in requests. failures:
    requests whose pages failed the integrity check (in this step or, for steps that sampled
    nothing, an earlier one), with the message and that step's start position (see failures);
    their tokens are garbage to be dropped."""

    sampled: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptScores] = field(default_factory=dict)
    failures: list[tuple[Request, str, int]] = field(default_factory=list)


@dataclass
class Launched:
    """A step queued on the device: its inputs, its sampled tokens and integrity status
    (device; pinned host copies and an event on CUDA), and what finish() may still need:
    logits when a request wants log-probabilities, hidden states when one scores its prompt
    (None otherwise, so a step launched ahead holds no more memory than it must)."""

    out: SchedulerOutput
    inputs: StepInputs
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None
    status: torch.Tensor | None = None  # [num_requests, 4], see ops.check_kv_pages
    host_status: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    starts: list[int] = field(default_factory=list)  # num_computed_tokens before this step


@dataclass
class PromptScores:
    """Scores of prompt tokens first, first+1, ...: top-k entries and/or full log-prob rows."""

    first: int
    entries: list[TokenLogprob] | None = None
    tensor: torch.Tensor | None = None  # [num_scored, vocab] fp32 log-probabilities


def score_prompt(compute_logits: Callable[[torch.Tensor], torch.Tensor], request: Request,
                 start: int, num_new: int, hidden: torch.Tensor, row: int) -> PromptScores | None:
    """Log-probabilities of the prompt tokens the chunk from position `start` predicts (the
    hidden state at position p scores prompt token p + 1), for tokens start+1 .. in order."""
    end = min(start + num_new, request.num_prompt_tokens - 1)
    if end <= start:
        return None
    p = request.params
    first = start if p.prompt_logprobs_tensor else min(max(start, p.prompt_logprobs_start - 1),
                                                         end)
    scores = PromptScores(first + 1, [] if p.prompt_logprobs is not None else None)
    rows = []
    for chunk in range(first, end, LOGITS_ROWS):  # bound the [rows, vocab] logits
        stop = min(chunk + LOGITS_ROWS, end)
        logits = compute_logits(hidden[row + chunk - start:row + stop - start])
        if scores.entries is not None:
            targets = torch.tensor(request.prompt_token_ids[chunk + 1:stop + 1],
                                   device=logits.device)
            scores.entries += token_logprobs(logits, targets,
                                             [p.prompt_logprobs] * (stop - chunk))
        if p.prompt_logprobs_tensor:
            rows.append(logits.log_softmax(dim=-1))
    if rows:
        scores.tensor = torch.cat(rows)
    return scores


def failures(step: Launched) -> list[tuple[Request, str, int]]:
    """The requests of a finished step whose pages failed the integrity check, with why and
    the position the step started from (what it was to write from there is not written)."""
    status = step.host_status if step.host_status is not None else step.status
    return [(step.out.requests[i], f"KV cache integrity check failed: page {page} expected tag "
             f"{expected}, found {found}", step.starts[i])
            for i, (failed, page, expected, found) in enumerate(status.tolist()) if failed]


def scores_prompt(request: Request, start: int) -> bool:
    """Whether a chunk of this request from position `start` has prompt tokens to score."""
    p = request.params
    wants = p.prompt_logprobs is not None or p.prompt_logprobs_tensor
    return wants and start < request.num_prompt_tokens - 1
