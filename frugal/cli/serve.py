"""`frugal serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal

from frugal.cli.args import add_engine_args, engine_config

logger = logging.getLogger("frugal")
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("FRUGAL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $FRUGAL_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model argument)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from frugal.engine.async_engine import AsyncEngine
    from frugal.engine.llm_engine import LLMEngine
    from frugal.server.metrics import Metrics
    from frugal.server.openai_api import build_app

    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    engine = LLMEngine(engine_config(args))
    metrics = Metrics(name)
    app = build_app(AsyncEngine(engine, metrics), name, args.api_key, metrics)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a handler of ours turns that
    # into a normal return, so a stopped server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    print(ready_message(name, args), flush=True)
    uvicorn.Server(config).run()
    logger.info("server stopped")
    return 0


def ready_message(name: str, args: argparse.Namespace) -> str:
    body = json.dumps({"model": name, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64})
    auth = " -H 'Authorization: Bearer $FRUGAL_API_KEY'" if args.api_key else ""
    url = f"http://{args.host}:{args.port}/v1/chat/completions"
    return (f"frugal: serving '{name}' on http://{args.host}:{args.port} (OpenAI API under /v1, "
            f"Prometheus at /metrics). Try:\n  curl {url} -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(body)}")
