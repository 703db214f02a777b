"""The engine: add_request / step / abort_request over scheduler, model runner, detokenizer."""

from __future__ import annotations

import itertools
import logging

import torch

from frugal.config import EngineConfig
from frugal.engine.detokenizer import IncrementalDetokenizer, find_stop
from frugal.engine.model_runner import ModelRunner
from frugal.engine.scheduler import Scheduler
from frugal.engine.step import Launched, StepResult
from frugal.loader import open_checkpoint
from frugal.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
)

logger = logging.getLogger("frugal")


class LLMEngine:
    """Continuous-batching engine. Not thread-safe: one caller drives add/step/abort."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        checkpoint = open_checkpoint(config.model, config.load_format, config.seed,
                                     config.quantization)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = mc = checkpoint.config
        wanted = config.scheduler.max_model_len or mc.max_position_embeddings
        if wanted > mc.max_position_embeddings:
            raise ValueError(f"max_model_len: {wanted} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.runner = ModelRunner(config, checkpoint)
        pool = self.runner.pool
        self.max_model_len = self.runner.max_model_len
        if self.max_model_len < wanted:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds no more",
                           wanted, self.max_model_len)
        self.scheduler = Scheduler(self.runner.allocator, pool.page_size,
                                   config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens)
        self.eos_token_ids = set(self.runner.sampler.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0  # total, for metrics
        self.num_integrity_failures = 0  # requests failed by the KV-cache integrity check
        self.overlap = config.overlap_schedule
        self._inflight: Launched | None = None  # a step launched ahead (see step)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises ValueError naming the bad field; on error
        nothing is queued and running requests are untouched."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not _is_token_id(t, vocab)]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]!r} is not a token id in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                             f"max_model_len {self.max_model_len}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(token_ids) + params.max_tokens)
        request = Request(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                          params, max_total)
        if params.seed is not None:
            request.generator = self.runner.sampler.make_generator(params.seed)
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer,
                                                                     params.skip_special_tokens)
        self.scheduler.add(request)
        return request_id

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Validated prompt token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt: expected text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if not _is_token_id(t, vocab):
                raise ValueError(f"prompt: token id {t!r} is not in [0, {vocab})")
        return list(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason 'abort' and free its pages now."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        return self._release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs for the requests that produced a token.

        A launched step counts at once in its requests' num_computed_tokens and, where it
        samples, num_pending. With overlap scheduling the next step is scheduled and launched
        before this one's tokens are read (see ModelRunner.can_follow): its pending tokens are
        gathered on the device, so the device never waits for the host's bookkeeping, and that
        next step is what the following call reads. A request that finished meanwhile has its
        row of it ignored; one whose pending token is its last is not scheduled again.
        """
        step, self._inflight = self._inflight, None
        if step is None:
            step = self._launch()
            if step is None:
                return []
        if self.overlap and self.runner.can_follow(step):
            self._inflight = self._launch(after=step)
        try:
            result = self.runner.finish(step)
        except BaseException:
            self._inflight = None  # it follows a step that will never be recorded
            raise
        outputs = self._apply(step, result)
        if self._inflight is not None and all(r.finished for r in self._inflight.out.requests):
            self._inflight = None  # nobody waits for it (the device still runs it, harmlessly)
        return outputs

    def _launch(self, after: Launched | None = None) -> Launched | None:
        """Schedule and launch a step (after: the step in flight it follows); None if there is
        nothing to run."""
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if not out.requests:
            return None
        step = self.runner.launch(out, after)
        for request, n in zip(out.requests, out.num_new_tokens):
            request.num_computed_tokens += n
        for i in step.inputs.sampled:
            out.requests[i].num_pending += 1
        return step

    def _apply(self, step: Launched, result: StepResult) -> list[RequestOutput]:
        """Record a finished step's tokens in its requests (skipping those finished meanwhile)."""
        out = step.out
        outputs = [self._fail(request, message) for request, message in result.failures
                   if not request.finished]
        for i, scores in result.prompt_logprobs.items():
            out.requests[i].record_prompt_scores(scores.first, scores.entries, scores.tensor)
        for j, (i, token) in enumerate(zip(result.sampled, result.tokens)):
            request = out.requests[i]
            request.num_pending -= 1
            if request.finished:
                continue
            request.output_token_ids.append(token)
            if j in result.logprobs:
                request.logprobs.append(result.logprobs[j])
            reason = self._check_stop(request, token)
            if reason is None:
                outputs.append(self._output(request))
            else:
                self.scheduler.finish(request, reason)
                outputs.append(self._release(request))
        return outputs

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """Abort a request whose pages failed the integrity check; nothing else is touched."""
        pages = [ref.page_id for ref in request.page_table]
        freed = self.scheduler.fail(request)
        request.error = message
        self.num_integrity_failures += 1
        logger.error("request %s failed: %s (its pages: %s; %d pages back in the free list)",
                     request.request_id, message, pages, freed)
        return self._release(request)

    def _check_stop(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        detok = self._detokenizers.get(request.request_id)
        delta = detok.update(request.output_token_ids) if detok is not None else ""
        if len(request.output_token_ids) >= params.min_tokens:
            if params.stop and delta:
                hit = find_stop(detok.text, len(delta), params.stop)
                if hit is not None:
                    detok.text = detok.text[:hit[0]]
                    request.stop_reason = hit[1]
                    return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                request.stop_reason = token
                return FinishReason.STOP
        if request.num_tokens >= request.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _release(self, request: Request) -> RequestOutput:
        """Final output of a finished request; forget it."""
        detok = self._detokenizers.get(request.request_id)
        if detok is not None and not isinstance(request.stop_reason, str):
            detok.update(request.output_token_ids, final=True)  # flush a trailing partial char
        output = self._output(request)
        self._requests.pop(request.request_id, None)
        self._detokenizers.pop(request.request_id, None)
        return output

    def _output(self, request: Request) -> RequestOutput:
        detok = self._detokenizers.get(request.request_id)
        text = detok.text if detok is not None else ""
        if not request.finished and request.params.stop:
            # hold back what could still become a stop string, so no part of one is ever shown
            hold = max(len(s) for s in request.params.stop) - 1
            text = text[:max(0, len(text) - hold)]
        params = request.params
        completion = CompletionOutput(
            0, text, list(request.output_token_ids),
            str(request.finish_reason) if request.finished else None, request.stop_reason,
            list(request.logprobs) if params.logprobs is not None else None, request.error)
        prompt_logprobs = prompt_tensor = None
        if request.num_prompt_scored == request.num_prompt_tokens - 1:
            if params.prompt_logprobs is not None:
                prompt_logprobs = list(request.prompt_logprobs)
            if params.prompt_logprobs_tensor and request.prompt_logprobs_rows:
                prompt_tensor = torch.cat(request.prompt_logprobs_rows)
                request.prompt_logprobs_rows = [prompt_tensor]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [completion], request.finished, prompt_logprobs, prompt_tensor)


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
