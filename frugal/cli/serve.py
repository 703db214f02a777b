"""`frugal serve`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import threading

from frugal.cli.args import add_engine_args, engine_config

logger = logging.getLogger("frugal")
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
FLUSH_S = 5.0  # after the shutdown timeout, what the error events get to reach their clients
LOG_STATS_S = 10.0  # seconds between two stats lines while requests run (vLLM's interval)
# a dead engine's server goes on answering (503; /health says why) this long before it exits 1,
# so a health check or load balancer sees the reason rather than a refused connection
DEAD_GRACE_S = 2.0


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", default=os.environ.get("FRUGAL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(and /metrics with --metrics-public) (default: $FRUGAL_API_KEY)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (a Prometheus scraper or "
                        "vllm-router that has none); its counters say what others' requests "
                        "did, prefix-cache hits included")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model argument)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM; then each "
                        "gets an error (streams: an error event, then [DONE])")
    g.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger bodies get a 413 before they are read (default 16 MiB)")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for a place in the batch beyond this get a 429 "
                        "(default: no limit)")
    g.add_argument("--no-ready-message", action="store_true",
                   help=argparse.SUPPRESS)  # (serve-pd's workers: it prints the router's)
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line in the log (by default every 10 s while requests run: "
                        "prompt and generation tokens/s, running, waiting, KV cache in use, "
                        "prefix-cache hit rate)")
    g.add_argument("--step-timeout", type=float, default=120.0,
                   help="a step that has not returned after this many seconds marks the "
                        "engine dead: every request gets an error and the server exits 1")
    g = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    g.add_argument("--kv-role", default=None, choices=["prefill", "decode", "both"],
                   help="take part in prefill/decode disaggregation behind vllm-router: a "
                        "NIXL agent over the KV pool (needs the 'pd' extra); requests' "
                        "kv_transfer_params say what each does")
    g.add_argument("--kv-secret", default=os.environ.get("FRUGAL_KV_SECRET"),
                   help="the deployment's shared secret (16+ characters; default: "
                        "$FRUGAL_KV_SECRET; required with --kv-role): hand-offs are signed with "
                        "it and the KV side channel asks for it")
    g.add_argument("--kv-peers", default=None,
                   help="host:port,...: the only workers this one exchanges KV pages with "
                        "(default: any that holds the secret)")
    g.add_argument("--kv-max-held-fraction", type=float, default=0.5,
                   help="share of the pool a prefill worker holds for decode workers at most; "
                        "past it such prefills get a 503")
    g.add_argument("--kv-host", default=None,
                   help="the address decode workers reach this worker at (default: --host, "
                        "or this machine's address when --host is 0.0.0.0)")
    g.add_argument("--kv-lease-timeout", type=float, default=120.0,
                   help="seconds a prefill's KV pages wait for the decode side's read")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a decode worker waits for a prompt's KV")
    g.add_argument("--kv-require-fast-path", action="store_true",
                   help="a decode worker refuses (503) hand-offs from a prefill worker whose "
                        "probe read went over TCP or through host memory, or failed (default: "
                        "a warning)")
    g.add_argument("--kv-transport", default="auto", choices=["auto", "nixl"],
                   help="auto: a prefill worker on this host whose KV pool maps into this one's "
                        "address space (one GPU through CUDA IPC, or host memory) is read by "
                        "a page copy of this worker's, any other over NIXL; nixl: NIXL always")
    p.set_defaults(func=run_serve)


def _no_probes(record: logging.LogRecord) -> bool:
    """Access-log lines, but not the health checks and scrapes that come every second."""
    path = record.args[2] if isinstance(record.args, tuple) and len(record.args) > 2 else ""
    return path not in ("/health", "/metrics")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or until the engine dies (exit 1)."""
    import uvicorn

    from frugal.engine.async_engine import AsyncEngine, EngineDeadError
    from frugal.engine.llm_engine import LLMEngine
    from frugal.metrics import Metrics
    from frugal.server.openai_api import build_app

    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    metrics = Metrics(name)
    kv_peers = check_kv_flags(args)
    engine_cfg = dataclasses.replace(engine_config(args), kv_role=args.kv_role,
                                     kv_lease_s=args.kv_lease_timeout,
                                     kv_transfer_timeout_s=args.kv_transfer_timeout,
                                     kv_secret=args.kv_secret if args.kv_role else None,
                                     kv_address=kv_address(args) if args.kv_role else None,
                                     kv_max_held_fraction=args.kv_max_held_fraction,
                                     kv_require_fast_path=args.kv_require_fast_path,
                                     kv_transport=args.kv_transport)
    engine = AsyncEngine(LLMEngine(engine_cfg), metrics, args.step_timeout,
                         log_stats=None if args.disable_log_stats else LOG_STATS_S)
    app = build_app(engine, name, args.api_key, metrics, args.max_request_bytes,
                    args.max_queued_requests, kv_peers, metrics_public=args.metrics_public)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.shutdown_timeout + FLUSH_S)

    logging.getLogger("uvicorn.access").addFilter(_no_probes)  # (after uvicorn's own config)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and not args.no_ready_message:  # bound: now the request works
                print(ready_message(name, args), flush=True)

        async def shutdown(self, sockets=None) -> None:
            async def cut_off() -> None:
                await asyncio.sleep(args.shutdown_timeout)
                logger.warning("shutdown timeout: failing the requests still in flight")
                engine.fail_all(EngineDeadError("the server is shutting down"))

            timer = asyncio.create_task(cut_off())
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    server = Server(config)

    def on_dead(reason: str) -> None:  # (any thread) answer 503s a moment, then exit 1
        timer = threading.Timer(DEAD_GRACE_S, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    engine.on_dead = on_dead
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; a handler of ours turns that
    # into a normal return, so a stopped server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if engine.dead is not None:
        logger.critical("server stopped: the engine died (%s)", engine.dead)
        return 1
    logger.info("server stopped")
    return 0 if server.started else 1


def check_kv_flags(args: argparse.Namespace) -> set[tuple[str, int]] | None:
    """--kv-peers as a set; ValueError, before the model loads, for a worker without the
    deployment's secret (or a short one) or with a bad --kv-peers."""
    from frugal.disagg.signing import Signer
    from frugal.server.side_channel import parse_peers

    if args.kv_role is None:
        return None
    if not args.kv_secret:
        raise ValueError("kv_secret: a prefill/decode worker needs the deployment's shared "
                         "secret: --kv-secret or $FRUGAL_KV_SECRET (`frugal serve-pd` makes one; "
                         "docs/disaggregation.md)")
    Signer(args.kv_secret)
    return parse_peers(args.kv_peers)


def kv_address(args: argparse.Namespace) -> tuple[str, int]:
    host = args.kv_host or args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return host, args.port


def ready_message(name: str, args: argparse.Namespace) -> str:
    body = json.dumps({"model": name, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64})
    auth = ""
    if args.api_key:  # double quotes, so the shell expands the variable
        from_env = args.api_key == os.environ.get("FRUGAL_API_KEY")
        auth = f' -H "Authorization: Bearer {"$FRUGAL_API_KEY" if from_env else "<api key>"}"'
    url = f"http://{args.host}:{args.port}/v1/chat/completions"
    return (f"frugal: serving '{name}' on http://{args.host}:{args.port} (OpenAI API under /v1, "
            f"Prometheus at /metrics). Try:\n  curl {url} -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(body)}")
