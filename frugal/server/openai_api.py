"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, errors, metrics.

Every error a client can cause comes back as a 4xx with {"error": {message, type, param, code}},
and every other error as a 500 with the same body; nothing a client sends reaches the engine
thread unvalidated. Work that grows with what a client sends (parsing and validating its body,
tokenizing, decoding, encoding a long answer) runs in the thread pool (body), so /health and
other clients are answered meanwhile.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from frugal.engine.async_engine import AsyncEngine
from frugal.metrics import Metrics
from frugal.server.body import add_schemas, documented, parsed
from frugal.server.gate import Gate
from frugal.server.jobs import Jobs, encode_chat
from frugal.server.protocol import (
    ERROR_RESPONSES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from frugal.server.serving import Serving
from frugal.server.side_channel import (
    AUTH_HEADER,
    HANDSHAKE_PATH,
    Peers,
    may_handshake,
    peer_addresses,
)

logger = logging.getLogger("frugal")


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              metrics: Metrics | None = None, max_request_bytes: int | None = None,
              max_queued_requests: int | None = None,
              kv_peers: set[tuple[str, int]] | None = None,
              metrics_public: bool = False) -> FastAPI:
    """An app serving `engine` as `model_name`. The engine thread starts and stops with the app.

    api_key: needed on every path but /health (and /metrics when metrics_public) and the side
    channel's /kv/* (see Gate); max_request_bytes: bodies over it get a 413 before anything
    reads them; max_queued_requests: requests beyond that many accepted and not yet running get
    a 429. kv_peers: the only (host, port)s of workers this one exchanges KV pages with
    (prefill/decode disaggregation; see side_channel), None for any holding the secret."""
    jobs, serving = Jobs(engine), Serving(engine)
    connector = engine.connector
    kv_role = connector.role is not None  # (a worker of prefill/decode disaggregation)
    signer = connector.signer if kv_role else None
    peers = Peers(signer, kv_peers) if signer is not None else None
    addresses = peer_addresses(kv_peers)
    tokenizer, max_model_len = engine.tokenizer, engine.max_model_len
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        if peers is not None:
            peers.close()
        engine.shutdown()

    app = FastAPI(title="frugal", lifespan=lifespan, responses=ERROR_RESPONSES)
    public = {"/health", "/metrics"} if metrics_public else {"/health"}
    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes,
                       public_paths=frozenset(public))

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: HTTPRequest, e: RequestValidationError):
        errors = e.errors()
        # a union reports every member; a member whose type matched says what is wrong
        first = next((x for x in errors if not x.get("type", "").endswith("_type")),
                     errors[0] if errors else {})
        loc = [str(part) for part in first.get("loc", ())[1:]  # past "body", without the
               if not (isinstance(part, str)  # union members' type tags
                       and (part in _TYPE_TAGS or "[" in part or "-" in part))]
        if first.get("type") == "json_invalid":
            return _error(APIError("request body is not valid JSON", code="invalid_json"))
        param = ".".join(loc) or None
        return _error(APIError(f"{param or 'body'}: {first.get('msg', 'invalid')}", param))

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, e: Exception):
        # Starlette's own answer is a plain-text 500, which OpenAI clients cannot parse; it
        # still logs the exception after this answer.
        return _error(APIError("internal server error", status=500, kind="server_error"))

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, e: HTTPException):
        response = _error(APIError(str(e.detail), status=e.status_code))
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(f"model: '{name}' does not exist (this server serves "
                           f"'{model_name}')", "model", status=404, code="model_not_found")

    async def run(build, model, http: HTTPRequest):
        """Parse, validate and tokenize on pool threads (the event loop stays free), admit, run."""
        req = await parsed(http, model)
        check_model(req.model)
        job = await run_in_threadpool(build, req)
        if job.kv_transfer is not None:
            if not kv_role:
                raise APIError("kv_transfer_params: this worker was started without --kv-role",
                               "kv_transfer_params")
            job.kv_transfer = await peers.attach(job.kv_transfer)
        if not engine.alive:
            raise APIError(f"the engine is not running: {engine.dead or 'stopped'}",
                           status=503, kind="server_error")
        if (max_queued_requests is not None
                and engine.num_queued + len(job.params) > max_queued_requests):
            raise APIError(f"the server's queue is full ({engine.num_queued} requests waiting, "
                           f"--max-queued-requests {max_queued_requests}); retry later",
                           status=429, code="rate_limit_exceeded", kind="rate_limit_error")
        stream = req.stream
        if stream:
            return StreamingResponse(serving.stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await serving.respond(job, http))

    @app.post("/v1/completions", responses=_STREAMED,
              openapi_extra=documented(CompletionRequest))
    async def completions(http: HTTPRequest):
        return await run(jobs.completion, CompletionRequest, http)

    @app.post("/v1/chat/completions", responses=_STREAMED,
              openapi_extra=documented(ChatCompletionRequest))
    async def chat_completions(http: HTTPRequest):
        return await run(jobs.chat, ChatCompletionRequest, http)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "frugal",
                "max_model_len": max_model_len, **engine.stats().kv_cache}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not engine.alive:
            state = f"engine dead: {engine.dead}" if engine.dead else "engine stopped"
            return JSONResponse({"status": state}, status_code=503)
        return {"status": "ok"}

    @app.get(HANDSHAKE_PATH, include_in_schema=False)
    async def kv_handshake(http: HTTPRequest):
        if not kv_role:
            raise APIError("this worker was started without --kv-role", status=404)
        if not may_handshake(signer, addresses, http.headers.get(AUTH_HEADER),
                             http.client.host if http.client else None):
            raise APIError("the KV side channel answers only workers of this deployment "
                           "(--kv-secret, --kv-peers)", status=401, code="invalid_kv_secret")
        return connector.metadata

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        if metrics is None:
            raise APIError("metrics are off", status=404)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # vLLM's tokenizer routes, which lm-evaluation-harness uses instead of a local tokenizer.
    # Their answers are made whole in the thread pool (a 15 MB text is 7.5 M ids).
    @app.post("/tokenize", openapi_extra=documented(TokenizeRequest))
    async def tokenize(http: HTTPRequest):
        req = await parsed(http, TokenizeRequest)
        if tokenizer is None:
            raise APIError("this model has no tokenizer", status=404)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("prompt: give exactly one of prompt and messages", "prompt")
        return Response(await run_in_threadpool(tokenize_answer, req),
                        media_type="application/json")

    def tokenize_answer(req: TokenizeRequest) -> bytes:
        """(a pool thread) More tokens than the context holds are a 400, as for a prompt."""
        if req.messages is not None:
            ids = encode_chat(tokenizer, conversation(req.messages), max_tokens=max_model_len)
        else:
            try:
                ids = tokenizer.encode(req.prompt, req.add_special_tokens, max_tokens=max_model_len)
            except ValueError as e:
                raise APIError.from_value_error(e) from e
        return (f'{{"tokens":{json_ids(ids)},"count":{len(ids)},'
                f'"max_model_len":{max_model_len}}}').encode()

    @app.post("/detokenize", openapi_extra=documented(DetokenizeRequest))
    async def detokenize(http: HTTPRequest):
        req = await parsed(http, DetokenizeRequest)
        if tokenizer is None:
            raise APIError("this model has no tokenizer", status=404)
        if len(req.tokens) > max_model_len:
            raise APIError(f"tokens: {len(req.tokens)} ids, more than this model's maximum "
                           f"context length of {max_model_len} tokens", "tokens",
                           code="context_length_exceeded")
        return await run_in_threadpool(detokenize_answer, req.tokens)

    def detokenize_answer(ids: list[int]) -> JSONResponse:  # encoded as it is made
        if any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise APIError(f"tokens: ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        if tokenizer is None:
            raise APIError("this model has no tokenizer", status=404)
        text = tokenizer.id_to_token
        return {"eos_token": text(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None
                else None,
                "bos_token": text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None
                else None,
                "pad_token": None, "chat_template": tokenizer.chat_template,
                "model_max_length": max_model_len}

    def openapi() -> dict:
        """FastAPI's schema, which also says the one model name this server takes."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            add_schemas(schema, list(_BODIES))
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [
                    model_name]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


_STREAMED = {200: {"description": "The completion, or with stream=true its Server-Sent Events",
                   "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
_BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_SLICE = 1 << 16  # ids json_ids encodes at once: ~5 ms with the GIL held


def json_ids(ids: list[int]) -> str:
    """ids as a JSON array, made slice by slice: between slices the GIL can go back to the event
    loop (json.dumps of 7.5 M ids holds it for half a second, the loop with it)."""
    return "[" + ",".join([",".join(map(str, ids[i:i + _SLICE]))
                           for i in range(0, len(ids), _SLICE)]) + "]"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)
