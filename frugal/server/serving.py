"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped bodies and SSE chunks out.

One HTTP request may carry several prompts and n choices each; every (prompt, choice) becomes one
engine request, numbered index = prompt * n + choice, and their outputs are merged as they come.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest

from frugal.disagg import HeldPagesFull
from frugal.engine.async_engine import AsyncEngine, EngineDeadError
from frugal.request import RequestOutput, SamplingParams, join
from frugal.server import logprobs as lp
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


class Serving:
    """Turns validated requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    # -- building jobs ----------------------------------------------------------------------

    def completion_job(self, req: CompletionRequest) -> Job:
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

    def chat_job(self, req: ChatCompletionRequest) -> Job:
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
                ids = self.engine.engine.tokenize(prompt, self.max_model_len)
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

    # -- running ----------------------------------------------------------------------------

    def _streams(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        return [self.engine.generate(job.prompts[i // job.n], params, f"{job.id}-{i}",
                                     job.kv_transfer, job.cache_salt)
                for i, params in enumerate(job.params)]

    async def respond(self, job: Job, http: HTTPRequest) -> dict:
        """Run every choice to the end; give up (aborting all) if the client goes away."""
        joined: dict[str, RequestOutput] = {}
        index: dict[str, int] = {}

        async def consume() -> None:
            async for i, out in merge(self._streams(job)):
                index[out.request_id] = i
                join(joined, out)

        task = asyncio.create_task(consume())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                _raise_as_api_error(task)
                break
            if await http.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError("client disconnected", status=499)
        outputs = sorted(joined.values(), key=lambda out: index[out.request_id])
        choices = [self._choice(job, i, out) for i, out in enumerate(outputs)]
        completion_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        body = {"id": job.id, "object": job.object, "created": int(time.time()),
                "model": job.model, "choices": choices, "usage": _usage(job, completion_tokens)}
        kv = outputs[0].kv_transfer_params if outputs else None
        if kv is not None:  # (signed by the engine: relayed as they are)
            body["kv_transfer_params"] = kv
        return body

    def _choice(self, job: Job, index: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        if job.kind == "chat":
            logprobs = None
            if c.logprobs is not None:
                logprobs = {"content": lp.chat_entries(self.tokenizer, c.logprobs)}
            return {"index": index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        text, logprobs = c.text, None
        prompt_text = job.prompt_texts[index // job.n]
        if job.echo:
            text = prompt_text + text
        if c.logprobs is not None:
            token_ids, entries = c.token_ids, c.logprobs
            if job.echo:
                token_ids = out.prompt_token_ids + token_ids
                entries = out.prompt_logprobs + entries
            logprobs = lp.completion_logprobs(self.tokenizer, token_ids, entries)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: OpenAI chunks, an optional usage chunk, then [DONE]. Closing the stream
        (a client disconnect) aborts every choice."""
        created = int(time.time())
        head = {"id": job.id, "object": f"{job.object}.chunk" if job.kind == "chat"
                else job.object, "created": created, "model": job.model}
        completion_tokens = 0
        usage = {"usage": None} if job.include_usage else {}
        try:
            for i in range(len(job.params)):
                first = ({"delta": {"role": "assistant", "content": ""}, "logprobs": None}
                         if job.kind == "chat" else
                         {"text": job.prompt_texts[i // job.n] if job.echo else "",
                          "logprobs": None})
                if job.kind == "chat" or job.echo:
                    yield _sse({**head, "choices": [{"index": i, **first,
                                                     "finish_reason": None}], **usage})
            async for i, out in merge(self._streams(job)):
                c = out.outputs[0]
                ids, new = c.token_ids, c.logprobs
                if new is not None and job.echo and out.prompt_logprobs is not None:
                    ids, new = out.prompt_token_ids + ids, out.prompt_logprobs + new  # once
                completion_tokens += len(c.token_ids)
                choice = self._chunk_choice(job, i, c.text, ids, new, c.finish_reason)
                yield _sse({**head, "choices": [choice], **usage})
            if job.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(job, completion_tokens)})
        except Exception as e:  # an error after the headers went out: say so, then end
            yield _sse(_api_error(e).body())
        yield "data: [DONE]\n\n"

    def _chunk_choice(self, job: Job, index: int, delta: str, token_ids: list[int],
                      new_logprobs: list | None, finish: str | None) -> dict:
        if job.kind == "chat":
            logprobs = None
            if new_logprobs is not None:
                logprobs = {"content": lp.chat_entries(self.tokenizer, new_logprobs)}
            return {"index": index, "delta": {"content": delta} if delta else {},
                    "logprobs": logprobs, "finish_reason": finish}
        logprobs = None
        if new_logprobs is not None:
            logprobs = lp.completion_logprobs(self.tokenizer, token_ids, new_logprobs)
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}


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


def _api_error(e: Exception) -> APIError:
    """Engine-side failures as OpenAI errors: a rejected request is the client's (400), anything
    else the server's (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError.from_value_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(str(e), status=503, kind="server_error")
    if isinstance(e, HeldPagesFull):
        return APIError(str(e), "kv_transfer_params", status=503, code="kv_pages_held",
                        kind="server_error")
    return APIError(f"engine error: {e}", status=500, kind="server_error")


def _raise_as_api_error(task: asyncio.Task) -> None:
    try:
        task.result()
    except Exception as e:
        raise _api_error(e) from e


def _usage(job: Job, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several async iterators as they arrive, tagged with the iterator's index.
    Leaving early cancels every iterator (which aborts its engine request). Each iterator is
    read one item ahead at most, so a consumer that stops reading stops them all, and what
    piles up meanwhile waits joined in each request's OutputStream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    slots = [asyncio.Semaphore(1) for _ in streams]  # taken while an item waits in the queue

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            await slots[i].acquire()
            async for item in stream:
                queue.put_nowait((i, item))
                await slots[i].acquire()
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                slots[i].release()
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
