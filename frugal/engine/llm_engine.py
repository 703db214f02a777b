"""The engine: add_request / step / abort_request over scheduler, model runner, detokenizer."""

from __future__ import annotations

import itertools
import logging
import time
import uuid

from frugal.config import EngineConfig
from frugal.core.kv_cache_manager import KVCacheManager
from frugal.core.page_allocator import IntegrityError
from frugal.core.scheduler import Scheduler
from frugal.disagg import wants_transfer
from frugal.disagg.connector import KVConnector, NullConnector
from frugal.engine.detokenizer import IncrementalDetokenizer
from frugal.engine.outputs import check_stop, delta_output, new_request, prompt_token_ids
from frugal.engine.stats import EngineStats, snapshot
from frugal.parallel import SINGLE
from frugal.request import FinishReason, Request, RequestOutput, SamplingParams
from frugal.worker import ranks
from frugal.worker.step import Launched, StepResult
from frugal.worker.worker import Worker

logger = logging.getLogger("frugal")


class LLMEngine:
    """Continuous-batching engine. Not thread-safe: one caller drives add/step/abort."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        checkpoint = ranks.load_checkpoint(config)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = mc = checkpoint.config
        wanted = config.scheduler.max_model_len or mc.max_position_embeddings
        if wanted > mc.max_position_embeddings:
            raise ValueError(f"max_model_len: {wanted} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        parallel, self._ranks = SINGLE, []
        if config.tensor_parallel_size > 1:
            parallel, self._ranks = ranks.start(config)
        self.worker = Worker(config, checkpoint, parallel)
        self.runner = self.worker.runner
        pool = self.worker.pool
        self.max_model_len = self.worker.max_model_len  # (lowered to what the pool holds)
        kv = KVCacheManager(pool.num_pages, pool.page_size, config.cache.enable_prefix_caching,
                            self.worker.kv_key())
        self.scheduler = Scheduler(kv, config.scheduler.max_num_seqs,
                                   config.resolved_batched_tokens())
        self.eos_token_ids = set(self.runner.sampler.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0  # total, for metrics
        self.num_integrity_failures = 0  # requests failed by the KV-cache integrity check
        self.num_bookkeeping_errors = 0  # contradictions found by check_integrity
        self.num_prompt_tokens = 0  # prompt tokens launched (totals, for the stats log)
        self.num_generation_tokens = 0  # tokens recorded
        # (the other ranks mirror each model call as it is made: no step launched ahead)
        self.overlap = config.overlap_schedule and parallel.size == 1
        self._inflight: Launched | None = None  # a step launched ahead (see step)
        # KV pages to and from other workers (prefill/decode disaggregation): disagg.connector
        self.connector: KVConnector = NullConnector()
        if config.kv_role is not None:
            from frugal.disagg.nixl_connector import NixlConnector
            self.connector = NixlConnector(self.scheduler, pool,
                                           f"frugal-{uuid.uuid4().hex[:12]}", mc.vocab_size,
                                           self.eos_token_ids, config)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, kv_transfer: dict | None = None,
                    cache_salt: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises ValueError naming the bad field; on error
        nothing is queued and running requests are untouched. kv_transfer: vLLM's
        kv_transfer_params (a prefill for another worker, or a decode of another worker's
        prefill; see disagg.connector). cache_salt: prefix-cache pages are shared only between
        requests with the same salt (None among themselves)."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = new_request(prompt, self.tokenize(prompt), params, request_id,
                              self.max_model_len, self.model_config.vocab_size, cache_salt)
        if wants_transfer(kv_transfer):
            self.connector.admit(request, kv_transfer)
        if params.seed is not None:
            request.generator = self.runner.sampler.make_generator(params.seed)
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.stop)
        self.scheduler.add(request)
        return request_id

    def tokenize(self, prompt: str | list[int], max_tokens: int | None = None) -> list[int]:
        """Validated prompt token ids (ValueError naming what is wrong; see prompt_token_ids)."""
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size,
                                max_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason 'abort' and free its pages now; None if there is no
        such unfinished request. Safe at any time between steps, and idempotent."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._end(request, FinishReason.ABORT)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with reason 'error' (after a step raised: what it launched is
        forgotten), leaving the engine idle and whole."""
        self._inflight = None
        self.runner.forget_unread()
        outputs = [self._end(r, FinishReason.ERROR, message)
                   for r in list(self._requests.values())]
        self.scheduler.kv.clear_cache()  # (what the forgotten steps were to write)
        return outputs

    def check_integrity(self) -> bool:
        """Walk the scheduler's bookkeeping (cheap between steps: the server does it whenever
        the engine is idle). A contradiction is a bug: it is logged as an error, the pages are
        recounted from the live page tables, and False is returned."""
        try:
            self.scheduler.check_integrity()
            return True
        except IntegrityError as e:
            self.num_bookkeeping_errors += 1
            freed = self.scheduler.recount()
            logger.error("KV cache bookkeeping is inconsistent: %s (%d pages back in the free "
                         "list after a recount)", e, freed)
            return False

    def close(self, leave: bool = True) -> None:
        """Stop the other tensor-parallel ranks, wait for them and leave their group (nothing to
        do without tensor parallelism); never hangs, even on a broken group (see ranks.stop).
        leave=False: a step may still be running on another thread (it never returned): the
        ranks are killed (failing its collective) and the group is left to a later close()."""
        processes = self._ranks
        if leave:
            self._ranks = []  # (lost_rank sees them no more: their exit is no news now)
        if processes:
            ranks.stop(self.runner.parallel, processes, leave)

    def lost_rank(self, error: BaseException | None = None) -> str | None:
        """Why the tensor-parallel group can run no more steps, or None (always None without
        tensor parallelism): a rank's process exited, or `error` (what a step raised) came from
        a collective (see ranks.lost). Cheap without error; safe from any thread."""
        return ranks.lost(self._ranks, error)

    def set_integrity(self, on: bool) -> None:
        """Turn the per-step KV-cache integrity check on or off between steps (benchmarks
        compare the two in one engine)."""
        self.runner.set_integrity(on, self.scheduler.kv.tags())

    @property
    def holds_pages(self) -> bool:
        """Pages are held for other workers (their reads need this side's polls)."""
        return bool(self.scheduler.kv.held)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        return snapshot(self)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs for the requests that produced a token (see _step). A step
        that raises leaves what the prefix cache was offered unknown: the cache is emptied."""
        try:
            return self._step()
        except BaseException:
            self.scheduler.kv.clear_cache()
            raise

    def _step(self) -> list[RequestOutput]:
        """Run one step; outputs for the requests that produced a token.

        A launched step counts at once in its requests' num_computed_tokens and, where it
        samples, num_pending. With overlap scheduling the next step is scheduled and launched
        before this one's tokens are read (see ModelRunner.can_follow): its pending tokens are
        gathered on the device, so the device never waits for the host's bookkeeping, and that
        next step is what the following call reads. A request that finished meanwhile has its
        row of it ignored; one whose pending token is its last is not scheduled again.
        """
        loaded = self.poll_transfers()
        step, self._inflight = self._inflight, None
        if step is None:
            step = self._launch()
            if step is None:
                if self.connector.busy and not loaded:
                    time.sleep(0.0005)  # only reads in flight: do not spin
                return loaded
        if self.overlap and self.runner.can_follow(step):
            self._inflight = self._launch(after=step)
        try:
            result = self.runner.finish(step)
        except BaseException:
            self._inflight = None  # it follows a step that will never be recorded
            raise
        outputs = loaded + self._apply(step, result)
        if self._inflight is not None and all(r.finished for r in self._inflight.out.requests):
            self._inflight = None  # nobody waits for it (the device still runs it, harmlessly)
        return outputs

    def _launch(self, after: Launched | None = None) -> Launched | None:
        """Schedule and launch a step (after: the step in flight it follows); None if there is
        nothing to run."""
        out = self.scheduler.schedule()
        self.num_preemptions += len(out.preempted)
        if out.loads:
            self.connector.start_loads(out.loads)
        if not out.requests:  # (pages may have changed hands: their tags go with a step)
            self.scheduler.kv.return_tag_updates(out.tag_updates)
            return None
        try:
            step = self.runner.launch(out, after)
        except BaseException:
            self.scheduler.kv.return_tag_updates(out.tag_updates)  # (the device never got them)
            raise
        for request, n in zip(out.requests, out.num_new_tokens):
            self.num_prompt_tokens += max(0, min(n, request.num_prompt_tokens
                                                 - request.num_computed_tokens))
            request.num_computed_tokens += n
        for i in step.inputs.sampled:
            out.requests[i].num_pending += 1
        return step

    def _apply(self, step: Launched, result: StepResult) -> list[RequestOutput]:
        """Record a finished step's tokens in its requests (skipping those finished meanwhile).
        A request whose handling raises is failed alone (reason 'error')."""
        out = step.out
        outputs = []
        for request, message, start in result.failures:
            if request.finished:
                continue
            sharers = self.scheduler.untrusted(request, start)
            outputs.append(self._end(request, FinishReason.ERROR, message, trusted=False))
            self.num_integrity_failures += 1
            outputs += [self._end(r, FinishReason.ERROR, f"its KV cache pages are shared with "
                                  f"request {request.request_id}, which failed the integrity "
                                  f"check before writing them") for r in sharers]
        for i, scores in result.prompt_logprobs.items():
            out.requests[i].record_prompt_scores(scores.first, scores.entries, scores.tensor)
        for j, (i, token) in enumerate(zip(result.sampled, result.tokens)):
            request = out.requests[i]
            request.num_pending -= 1
            if not request.finished:
                self.num_generation_tokens += 1
                outputs.append(self._record(request, token, result.logprobs.get(j)))
        return outputs

    def _record(self, request: Request, token: int, logprob) -> RequestOutput:
        """A new token of the request: its output, or its last one when it stops there. A
        request whose handling raises is failed alone."""
        try:
            request.output_token_ids.append(token)
            if logprob is not None:
                request.logprobs.append(logprob)
            reason = check_stop(request, token, self._detokenizers.get(request.request_id),
                                self.eos_token_ids)
            return self._output(request) if reason is None else self._end(request, reason)
        except Exception as e:  # a bug in one request's bookkeeping: fail it, not the step
            logger.exception("request %s failed while recording its token", request.request_id)
            return self._end(request, FinishReason.ERROR, f"engine error: {e}")

    def poll_transfers(self) -> list[RequestOutput]:
        """Look at KV transfers (see disagg.connector): frees pages other workers are done
        with; a request whose KV arrived runs from its prompt's end, with the other worker's
        first token recorded where it stands; one whose transfer failed ends with an error.
        Call it even when idle (a prefill worker's leases)."""
        loaded, failed = self.connector.poll()
        outputs = [self._end(r, FinishReason.ERROR, e) for r, e in failed if not r.finished]
        for load in loaded:
            request = load.request
            if request.finished:
                continue
            self.scheduler.loaded(request, load.num_computed_tokens)
            if load.first is not None:
                token, logprob = load.first
                outputs.append(self._record(request, token, logprob
                                            if request.params.logprobs is not None else None))
        return outputs

    def _end(self, request: Request, reason: FinishReason, error: str | None = None,
             trusted: bool = True) -> RequestOutput:
        """Finish a request (pages freed; see Scheduler.finish), its last output; forget it.
        error: why, for reason 'error' (trusted False: its pages failed the integrity check)."""
        pages = [ref.page_id for ref in request.page_table]
        kv_params, hold = self.connector.request_finished(request, reason)
        problem = self.scheduler.finish(request, reason, trusted, hold)
        request.error = error
        if problem is not None and trusted:  # freeing found what no check had caught
            self.num_bookkeeping_errors += 1
        if error is not None or problem is not None:
            logger.error("request %s ended (%s): %s; its pages: %s", request.request_id, reason,
                         "; ".join(m for m in (error, problem) if m), pages)
        detok = self._detokenizers.get(request.request_id)
        if detok is not None and not isinstance(request.stop_reason, str):
            detok.update(request.output_token_ids, final=True)  # flush a trailing partial char
        output = self._output(request)
        output.kv_transfer_params = kv_params
        self._requests.pop(request.request_id, None)
        self._detokenizers.pop(request.request_id, None)
        return output

    def _output(self, request: Request) -> RequestOutput:
        return delta_output(request, self._detokenizers.get(request.request_id))
