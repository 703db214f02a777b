"""`frugal serve-pd`: prefill and decode workers behind vllm-router, on one machine.

Starts `frugal serve --kv-role prefill` and N `frugal serve --kv-role decode` processes on the
ports after the router's, waits for their /health, then runs `vllm-router
--vllm-pd-disaggregation` in front of them; SIGTERM or Ctrl-C stops them all. Across machines,
start the workers and the router yourself (docs/disaggregation.md).

The workers share a secret made for this deployment (or $FRUGAL_KV_SECRET), passed in their
environment: hand-offs are signed with it and the KV side channel asks for it. With an API key
(--api-key or $FRUGAL_API_KEY) the workers require it too, the router calls them with it
(vllm-router sends $OPENAI_API_KEY, not the client's key) on a loopback port after the
workers', and frugal's relay (server.proxy) checks clients' keys on the public port.
"""

from __future__ import annotations

import argparse
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
            "--host", host, "--port", str(port), "--kv-role", role, *shlex.split(flags)]


def router_command(host: str, port: int, prefill: list[str], decode: list[str],
                   flags: str = "") -> list[str]:
    """vllm-router in its vLLM PD mode (NIXL), health checked every second, its own metrics
    on loopback."""
    exe = shutil.which("vllm-router") or str(_venv_bin("vllm-router"))
    command = [exe, "--vllm-pd-disaggregation", "--host", host, "--port", str(port),
               "--prometheus-host", "127.0.0.1",
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


def relay_command(host: str, port: int, upstream: str, log_level: str) -> list[str]:
    """frugal's API-key relay in front of the router (the key from $FRUGAL_API_KEY)."""
    return [sys.executable, "-m", "frugal.server.proxy", "--upstream", upstream, "--host", host,
            "--port", str(port), "--log-level", log_level.lower()]


def run_serve_pd(args: argparse.Namespace) -> int:
    if shutil.which("vllm-router") is None and not _venv_bin("vllm-router").exists():
        raise ValueError("serve-pd needs vllm-router: pip install 'frugal[pd]'")
    common = f"{args.args} --log-level {args.log_level}"
    roles = [("prefill", args.prefill_args)] + [("decode", args.decode_args)] * args.num_decode
    # secrets travel in the environment, which other users cannot read (argv they can)
    env = {**os.environ, "FRUGAL_KV_SECRET": os.environ.get("FRUGAL_KV_SECRET")
           or secrets.token_urlsafe(32)}
    env.pop("FRUGAL_API_KEY", None)
    if args.api_key:
        env["FRUGAL_API_KEY"] = args.api_key
    processes, urls = [], {"prefill": [], "decode": []}
    try:
        for i, (role, flags) in enumerate(roles):
            port = args.port + 1 + i
            processes.append(subprocess.Popen(worker_command(args.model, role, args.host, port,
                                                             f"{common} {flags}"), env=env))
            urls[role].append(f"http://{args.host}:{port}")
        for process, url in zip(processes, urls["prefill"] + urls["decode"]):
            wait_healthy(url, process)
        if args.api_key:  # the router behind frugal's relay, on loopback
            host, port = "127.0.0.1", args.port + 1 + len(roles)
        else:
            host, port = args.host, args.port
        router_env = {k: v for k, v in env.items() if k not in ("FRUGAL_KV_SECRET",
                                                                 "FRUGAL_API_KEY")}
        if args.api_key:
            router_env["OPENAI_API_KEY"] = args.api_key
        router = subprocess.Popen(router_command(host, port, urls["prefill"], urls["decode"],
                                                 args.router_args), env=router_env)
        processes.append(router)
        if args.api_key:
            relay_env = {k: v for k, v in env.items() if k != "FRUGAL_KV_SECRET"}
            processes.append(subprocess.Popen(relay_command(
                args.host, args.port, f"http://{host}:{port}", args.log_level), env=relay_env))
        print(f"frugal: serve-pd on http://{args.host}:{args.port} (vllm-router; prefill "
              f"{', '.join(urls['prefill'])}; decode {', '.join(urls['decode'])})", flush=True)
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
