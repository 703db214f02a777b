"""/v1/completions and /v1/chat/completions: Jobs run, OpenAI-shaped bodies and SSE chunks out.

A Job's (prompt, choice) pairs run as one engine request each (see jobs), their outputs merged as
they come; the client going away, or a stream closed early, aborts them all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest

from frugal.disagg import Unavailable
from frugal.engine.async_engine import AsyncEngine, EngineDeadError
from frugal.request import RequestOutput, join
from frugal.server import logprobs as lp
from frugal.server.jobs import Job
from frugal.server.protocol import APIError


class Serving:
    """Runs Jobs on an engine and turns their outputs into responses."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # (for the logprobs' token texts)

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


def _api_error(e: Exception) -> APIError:
    """Engine-side failures as OpenAI errors: a rejected request is the client's (400), anything
    else the server's (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError.from_value_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(str(e), status=503, kind="server_error")
    if isinstance(e, Unavailable):
        return APIError(str(e), "kv_transfer_params", status=503, code=e.code,
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
