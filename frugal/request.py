"""Requests and their outputs: plain dataclasses shaped like vLLM's offline API."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from frugal.core.page_table import PageTable


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # failed by the engine (its KV pages failed the integrity check)

    def __str__(self) -> str:
        return self.value


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k -1 (or 0) and top_p 1.0 disable those filters.
    max_tokens None means up to the model's context. Stop strings are not part of the output text.
    min_tokens: no EOS, stop token or stop string ends the output before this many tokens.
    logprobs: also report each output token's log-probability and this many top alternatives;
    prompt_logprobs: the same for every prompt token after the first (None: neither).
    prompt_logprobs_tensor: also return every prompt position's whole log-probability vector
    as one tensor (RequestOutput.prompt_logprobs_tensor), as KL divergence needs.
    prompt_logprobs_start: only prompt tokens from this index on are scored (those before are
    None), so that a prompt's head may come from the prefix cache (a multiple-choice context).
    prompt_from_cache: the prompt's tokens attend to one another through the KV cache, as decode
    steps read them, instead of to their keys and values as computed (AttentionMetadata.fresh_kv;
    the two differ only over a quantized cache): teacher-forced scoring that should measure the
    cache's effect at every position asks for it (eval's generation KL, the start-up KV check).
    A step holding such a request reads every request's prompt tokens so.
    Log-probabilities are those of the model's raw distribution (before temperature/top-k/top-p).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_tensor: bool = False
    prompt_logprobs_start: int = 0
    prompt_from_cache: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also false for NaN
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed: must be a 64-bit signed integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if not _is_int(self.prompt_logprobs_start) or self.prompt_logprobs_start < 0:
            raise ValueError(f"prompt_logprobs_start: must be an integer >= 0, got "
                             f"{self.prompt_logprobs_start!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop or [], list) or any(
                not isinstance(s, str) or not s for s in self.stop or []):
            raise ValueError(f"stop: must be a non-empty string or a list of them, "
                             f"got {self.stop!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TokenLogprob:
    """A token's log-probability and the most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One completion's progress since the previous output of its request (the engine's outputs
    are deltas; RequestOutput.add joins them): new text, new token ids (a final EOS/stop token
    included), their log-probabilities. finish_reason is set on the last one."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step: what is new since its previous
    output (see CompletionOutput). Prompt scores come in one output, once all are computed.
    LLM.generate returns the outputs of each request joined into one (add)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, lp(token 1), ...] if asked
    # [num_prompt_tokens - 1, vocab] log-probabilities of prompt tokens 1.. (prompt_logprobs_tensor)
    prompt_logprobs_tensor: torch.Tensor | None = None
    # a prefill for another worker: where its KV is and how to check it (disagg.connector)
    kv_transfer_params: dict | None = None

    def add(self, later: RequestOutput) -> RequestOutput:
        """Append a later output of the same request to this one (in place); returns self.
        Costs O(what later carries), so joining a request's outputs is linear in its length."""
        mine, theirs = self.outputs[0], later.outputs[0]
        mine.text += theirs.text
        mine.token_ids += theirs.token_ids
        if theirs.logprobs is not None:
            if mine.logprobs is None:
                mine.logprobs = []
            mine.logprobs += theirs.logprobs
        mine.finish_reason, mine.stop_reason = theirs.finish_reason, theirs.stop_reason
        mine.error = theirs.error
        self.finished = later.finished
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if self.prompt_logprobs_tensor is None:
            self.prompt_logprobs_tensor = later.prompt_logprobs_tensor
        if self.kv_transfer_params is None:
            self.kv_transfer_params = later.kv_transfer_params
        return self


def join(joined: dict[str, RequestOutput], output: RequestOutput) -> RequestOutput:
    """Add an engine output to the joined output of its request in `joined` (the first output
    of a request becomes it); returns the joined output."""
    first = joined.setdefault(output.request_id, output)
    return first if first is output else first.add(output)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # its prompt's KV is on its way from another worker
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request's state across steps.

    Invariants: num_computed_tokens <= num_tokens + num_pending; tokens [0, num_computed_tokens)
    have their KV in the pages of page_table (page i holds positions [i*page_size,
    (i+1)*page_size)), or will have once the steps launched so far have run. num_pending: tokens
    sampled by a launched step and not yet in output_token_ids (0 or 1 between steps; while a
    step is launched ahead of the one being read, 2); they follow the known tokens.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output tokens this request may produce
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    page_table: PageTable = field(default_factory=PageTable)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # a seeded request's own sampling noise
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    prompt_logprobs_rows: list[torch.Tensor] = field(default_factory=list)
    num_prompt_scored: int = 0  # prompt tokens 1..num_prompt_scored have their scores recorded
    error: str | None = None  # set with FinishReason.ERROR
    num_sent: int = 0  # output tokens (and their log-probabilities) already in an output
    prompt_scores_sent: bool = False
    # its prompt's KV comes from another worker (a KV connector admitted it, disagg.connector):
    # the scheduler gives it pages and keeps it loading until the connector reports them filled
    kv_from_remote: bool = False
    cache_salt: str | None = None  # prefix-cache entries are shared only under the same salt
    page_hashes: list[bytes] = field(default_factory=list)  # of its full pages (PrefixCache)
    num_cached_pages: int = 0  # leading pages of page_table the prefix cache has been offered

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens known or sampled by a launched step: what steps may compute up to."""
        return self.num_tokens + self.num_pending

    @property
    def reads_prefix_cache(self) -> bool:
        """False when it scores every prompt token (their logits must all be computed)."""
        p = self.params
        return not p.prompt_logprobs_tensor and (p.prompt_logprobs is None
                                                 or p.prompt_logprobs_start > 1)

    @property
    def num_cacheable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: the known ones but the last
        (computed for its logits); none when every prompt token is scored, those before
        prompt_logprobs_start - 1 when only the later ones are."""
        p = self.params
        if not self.reads_prefix_cache:
            return 0
        limit = min(self.num_tokens, self.num_tokens_with_pending - 1)
        if p.prompt_logprobs is not None:
            limit = min(limit, p.prompt_logprobs_start - 1)
        return max(0, limit)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def record_prompt_scores(self, first: int, entries: list[TokenLogprob] | None,
                             rows: torch.Tensor | None) -> None:
        """Keep the scores of prompt tokens first, first+1, ... not yet recorded (a recompute
        after preemption scores tokens again: the first scores stay). Tokens skipped before
        `first` (before prompt_logprobs_start, or from the prefix cache) get None."""
        gap = first - (self.num_prompt_scored + 1)
        if gap > 0 and entries is not None:
            self.prompt_logprobs += [None] * gap
            self.num_prompt_scored += gap
        skip = max(0, self.num_prompt_scored + 1 - first)
        count = len(entries) if entries is not None else rows.shape[0]
        if entries is not None:
            self.prompt_logprobs += entries[skip:]
        if rows is not None and skip < rows.shape[0]:
            self.prompt_logprobs_rows.append(rows[skip:])
        self.num_prompt_scored += max(0, count - skip)
