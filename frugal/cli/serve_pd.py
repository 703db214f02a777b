"""`frugal serve-pd`: prefill and decode workers behind vllm-router, on one machine.

Starts `frugal serve --kv-role prefill` and N `frugal serve --kv-role decode` processes on the
ports after the router's, waits for their /health, then runs `vllm-router
--vllm-pd-disaggregation` in front of them; SIGTERM or Ctrl-C stops them all. Across machines,
start the workers and the router yourself (docs/disaggregation.md).

The workers listen on loopback and share a secret made for this deployment (or
$FRUGAL_KV_SECRET), passed in their environment: hand-offs are signed with it and the KV side
channel asks for it. They also require a key of the deployment's own (or $FRUGAL_WORKER_KEY),
which the router sends (vllm-router calls workers with $OPENAI_API_KEY, not a client's key), so
no client reaches a worker. With an API key (--api-key or $FRUGAL_API_KEY) the router listens
on a loopback port after the workers' and frugal's relay (server.proxy) checks clients' keys on
the public port.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from frugal.cli.serve import DEFAULT_SERVED_NAME


def add_serve_pd_parser(subparsers) -> None:
    p = subparsers.add_parser("serve-pd", help="prefill and decode workers behind vllm-router")
    p.add_argument("model", nargs="?", default=None, help="as for `frugal serve`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port; the workers "
                   "take the next ones")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--prefill-args", default="", help="more `frugal serve` flags for the "
                   "prefill worker, e.g. '--quantization fp8'")
    p.add_argument("--decode-args", default="", help="more flags for each decode worker, "
                   "e.g. '--quantization int4'")
    p.add_argument("--args", default="", help="flags for every worker, e.g. "
                   "'--kv-cache-memory 4GiB'")
    p.add_argument("--router-args", default="--policy round_robin",
                   help="more vllm-router flags")
    p.add_argument("--api-key", default=os.environ.get("FRUGAL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' of clients (default: "
                        "$FRUGAL_API_KEY); the workers require it too")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_serve_pd)


def worker_command(model: str | None, role: str, host: str, port: int, flags: str) -> list[str]:
    return [sys.executable, "-m", "frugal.cli.main", "serve", *([model] if model else []),
            "--host", host, "--port", str(port), "--kv-role", role, "--no-ready-message",
            *shlex.split(flags)]


def router_command(host: str, port: int, prefill: list[str], decode: list[str],
                   flags: str = "") -> list[str]:
    """vllm-router in its vLLM PD mode (NIXL), health checked every second, its own metrics
    on loopback."""
    exe = shutil.which("vllm-router") or str(_venv_bin("vllm-router"))
    command = [exe, "--vllm-pd-disaggregation", "--host", host, "--port", str(port),
               "--log-level", "warning", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(port + 20000 if port < 45535 else port - 20000),
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    for url in prefill:
        command += ["--prefill", url]
    for url in decode:
        command += ["--decode", url]
    return command + shlex.split(flags)


def _venv_bin(name: str) -> Path:
    return Path(sys.executable).parent / name


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the worker exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy after {timeout:g} s")


def try_command(args: argparse.Namespace) -> str:
    """A request to paste, at the router's address (the key from the environment)."""
    flags = shlex.split(args.args)
    name = (flags[flags.index("--served-model-name") + 1] if "--served-model-name" in flags[:-1]
            else args.model or DEFAULT_SERVED_NAME)
    body = json.dumps({"model": name,
                       "messages": [{"role": "user", "content": "What is the capital of "
                                     "France?"}], "max_tokens": 64})
    auth = ' -H "Authorization: Bearer $FRUGAL_API_KEY"' if args.api_key else ""
    return (f"curl http://{args.host}:{args.port}/v1/chat/completions -H 'Content-Type: "
            f"application/json'{auth} -d {shlex.quote(body)}")


def relay_command(host: str, port: int, upstream: str, log_level: str) -> list[str]:
    """frugal's API-key relay in front of the router (the key from $FRUGAL_API_KEY)."""
    return [sys.executable, "-m", "frugal.server.proxy", "--upstream", upstream, "--host", host,
            "--port", str(port), "--log-level", log_level.lower()]


def run_serve_pd(args: argparse.Namespace) -> int:
    if shutil.which("vllm-router") is None and not _venv_bin("vllm-router").exists():
        raise ValueError("serve-pd needs vllm-router: pip install 'frugal[pd]'")
    common = f"{args.args} --log-level {args.log_level}"
    roles = [("prefill", args.prefill_args)] + [("decode", args.decode_args)] * args.num_decode
    # Secrets travel in the environment, which other users cannot read (argv they can). The
    # workers listen on loopback and require a key of the deployment's own, which the router
    # sends; clients reach the router (or the relay, which checks their key) alone.
    base = {k: v for k, v in os.environ.items() if k not in ("FRUGAL_API_KEY", "OPENAI_API_KEY",
                                                             "FRUGAL_KV_SECRET")}
    worker_key = os.environ.get("FRUGAL_WORKER_KEY") or secrets.token_urlsafe(32)
    worker_env = {**base, "FRUGAL_API_KEY": worker_key, "FRUGAL_KV_SECRET":
                  os.environ.get("FRUGAL_KV_SECRET") or secrets.token_urlsafe(32)}
    processes, urls = [], {"prefill": [], "decode": []}
    try:
        for i, (role, flags) in enumerate(roles):
            port = args.port + 1 + i
            processes.append(subprocess.Popen(worker_command(
                args.model, role, "127.0.0.1", port, f"{common} {flags}"), env=worker_env))
            urls[role].append(f"http://127.0.0.1:{port}")
        for process, url in zip(processes, urls["prefill"] + urls["decode"]):
            wait_healthy(url, process)
        if args.api_key:  # the router behind frugal's relay, on loopback
            host, port = "127.0.0.1", args.port + 1 + len(roles)
        else:
            host, port = args.host, args.port
        router = subprocess.Popen(router_command(host, port, urls["prefill"], urls["decode"],
                                                 args.router_args),
                                  env={**base, "OPENAI_API_KEY": worker_key})
        processes.append(router)
        if args.api_key:
            processes.append(subprocess.Popen(relay_command(
                args.host, args.port, f"http://{host}:{port}", args.log_level),
                env={**base, "FRUGAL_API_KEY": args.api_key}))
        print(f"frugal: serve-pd on http://{args.host}:{args.port} (vllm-router; prefill "
              f"{', '.join(urls['prefill'])}; decode {', '.join(urls['decode'])}). Try:\n  "
              f"{try_command(args)}", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        workers = dict(zip(processes, urls["prefill"] + urls["decode"]))
        while all(p.poll() is None for p in processes[len(roles):]):  # router (and relay)
            # a dead worker: the router sends requests elsewhere
            for process, url in list(workers.items()):
                if process.poll() is not None:
                    print(f"frugal: serve-pd: the worker at {url} exited with "
                          f"{process.returncode}", file=sys.stderr, flush=True)
                    del workers[process]
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
