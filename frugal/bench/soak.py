"""`frugal bench soak`: a bounded fault soak of a running server.

--num-requests requests, at most --concurrency in flight, each one at random: a good request
(streamed or not, random prompt and output lengths), a client that disconnects part way, or a
bad request. Good requests must succeed with the tokens they asked for, bad ones must get a 4xx
with an OpenAI error body, and nothing may get a 5xx. Afterwards the server must be idle with
every KV page free, and (frugal's /metrics) its idle bookkeeping walk must have run clean, with
no request errored. Prints a table and exits 1 on any violation. Prompts are token ids, so any
model works (dummy weights too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field

from frugal.cli.args import command_line

BAD = [  # (body, what the answer must be)
    (b"{not json", 400),
    (b'{"model": "%(model)s", "prompt": "\\ud800 x"}', 400),
    (b'{"model": "%(model)s", "prompt": [1, 2], "max_tokens": -3}', 400),
    (b'{"model": "%(model)s", "prompt": [1, 2], "temperature": "hot"}', 400),
    (b'{"model": "no-such-model", "prompt": [1, 2]}', 404),
    (b'{"model": "%(model)s", "prompt": [1, 2], "stop": ["a", "b", "c", "d", "e", "f", "g", '
     b'"h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}', 400),
    (b'{"model": "%(model)s", "prompt": [1, 2], "max_tokens": 100000000}', 400),
]


@dataclass
class Report:
    kinds: Counter = field(default_factory=Counter)  # requests sent, by kind
    statuses: Counter = field(default_factory=Counter)  # answers, by HTTP status
    problems: list[str] = field(default_factory=list)  # every violation seen
    final: dict[str, float] = field(default_factory=dict)  # /metrics once settled


def add_soak_parser(sub) -> None:
    s = sub.add_parser("soak", help="bounded fault soak of a running server")
    s.add_argument("--url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--num-requests", type=int, default=1000)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--max-prompt-len", type=int, default=256)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--disconnect-rate", type=float, default=0.2)
    s.add_argument("--bad-rate", type=float, default=0.05)
    s.add_argument("--token-range", default="100,1000", help="prompt token ids from [LO, HI)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args))
    print(format_report(report, args))
    return 1 if report.problems else 0


async def soak(args: argparse.Namespace) -> Report:
    url = urllib.parse.urlsplit(args.url)
    client = _Client(url.hostname, url.port or 80, args.api_key, args.timeout)
    model = args.model or json.loads((await client.call("GET", "/v1/models"))[1])["data"][0]["id"]
    before = await _metrics(client)
    report, rng = Report(), random.Random(args.seed)
    lo, hi = map(int, args.token_range.split(","))
    slots = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        r = random.Random(rng.random())
        async with slots:
            roll = r.random()
            if roll < args.bad_rate:
                await _bad(client, r, model, report)
            else:
                body = {"model": model, "prompt": [r.randrange(lo, hi) for _ in range(
                            r.randint(1, args.max_prompt_len))],
                        "max_tokens": r.randint(1, args.max_tokens), "ignore_eos": True,
                        "stream": r.random() < 0.5, "temperature": r.choice([0.0, 0.8]),
                        "seed": i}
                if body["stream"]:
                    body["stream_options"] = {"include_usage": True}
                leave = roll < args.bad_rate + args.disconnect_rate
                await (_disconnect(client, r, body, report) if leave
                       else _good(client, body, report))

    await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    await _settle(client, before, report)
    return report


async def _good(client: _Client, body: dict, report: Report) -> None:
    kind = "good stream" if body["stream"] else "good"
    report.kinds[kind] += 1
    status, raw = await client.call("POST", "/v1/completions", body)
    report.statuses[status] += 1
    if status != 200:
        report.problems.append(f"{kind}: HTTP {status}: {raw[:200]!r}")
        return
    if body["stream"]:
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]" or any(b'"error"' in e[:10] for e in events):
            report.problems.append(f"{kind}: stream ended badly: {events[-2:]!r}")
            return
        usage = json.loads(events[-2])["usage"]
    else:
        usage = json.loads(raw)["usage"]
    if usage["completion_tokens"] != body["max_tokens"]:
        report.problems.append(f"{kind}: {usage['completion_tokens']} tokens for max_tokens "
                               f"{body['max_tokens']} (ignore_eos)")


async def _disconnect(client: _Client, r: random.Random, body: dict, report: Report) -> None:
    report.kinds["disconnect"] += 1
    await client.call("POST", "/v1/completions", body, leave_after=r.uniform(0.0, 1.0))


async def _bad(client: _Client, r: random.Random, model: str, report: Report) -> None:
    report.kinds["bad"] += 1
    body, want = r.choice(BAD)
    status, raw = await client.call("POST", "/v1/completions", body % {b"model": model.encode()})
    report.statuses[status] += 1
    try:
        ok = status == want and set(json.loads(raw)["error"]) >= {"message", "type"}
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        report.problems.append(f"bad request {body[:40]!r}: HTTP {status} (want {want}): "
                               f"{raw[:200]!r}")


async def _settle(client: _Client, before: dict[str, float], report: Report) -> None:
    """The server must come back to idle, every page free, its bookkeeping walked clean."""
    deadline = time.monotonic() + 60
    while True:
        m = await _metrics(client)
        idle = (m.get("frugal_num_requests_running") == 0
                and m.get("frugal_num_requests_waiting") == 0
                and m.get("frugal_kv_cache_pages_used") == 0)
        walked = m.get("frugal_kv_bookkeeping_checks_total", 0) > before.get(
            "frugal_kv_bookkeeping_checks_total", 0)
        if (idle and walked) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    report.final = m
    if not idle:
        report.problems.append("not idle afterwards: " + ", ".join(
            f"{k}={m.get(k)}" for k in ("frugal_num_requests_running",
                                        "frugal_num_requests_waiting",
                                        "frugal_kv_cache_pages_used")))
    if not walked:
        report.problems.append("no bookkeeping walk ran once idle")
    for name in ("frugal_kv_bookkeeping_errors_total", "frugal_requests_errored_total",
                 "frugal_kv_integrity_failures_total"):
        grew = m.get(name, 0) - before.get(name, 0)
        if grew:
            report.problems.append(f"{name} grew by {grew:g}")


async def _metrics(client: _Client) -> dict[str, float]:
    status, raw = await client.call("GET", "/metrics")
    values = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{", 1)[0]] = float(value)
    return values


class _Client:
    """HTTP/1.1 on asyncio streams, one connection a request ("Connection: close"), so a
    disconnect is a real one and nothing a client library does hides the server's answer."""

    def __init__(self, host: str, port: int, api_key: str | None, timeout: float) -> None:
        self.host, self.port, self.api_key, self.timeout = host, port, api_key, timeout

    async def call(self, method: str, path: str, body: dict | bytes | None = None,
                   leave_after: float | None = None) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nConnection: close\r\n"
            if self.api_key:
                head += f"Authorization: Bearer {self.api_key}\r\n"
            if data is not None:
                head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            writer.write(head.encode() + b"\r\n" + (data or b""))
            if leave_after is not None:
                await asyncio.sleep(leave_after)
                return 0, b""
            raw = await asyncio.wait_for(reader.read(), self.timeout)
        finally:
            writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        headers, _, payload = rest.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in headers.lower():
            payload = _dechunk(payload)
        return int(status_line.split()[1]), payload


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        end = data.index(b"\r\n", i)
        size = int(data[i:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2:end + 2 + size])
        i = end + 4 + size


def format_report(report: Report, args: argparse.Namespace) -> str:
    kinds, final = report.kinds, report.final
    server_errors = sum(n for status, n in report.statuses.items() if status >= 500)
    after = ", ".join(f"{k.removeprefix('frugal_')}={final.get(k, 0):g}" for k in (
        "frugal_num_requests_running", "frugal_num_requests_waiting",
        "frugal_kv_cache_pages_used", "frugal_kv_bookkeeping_checks_total",
        "frugal_kv_bookkeeping_errors_total", "frugal_requests_errored_total",
        "frugal_requests_aborted_total", "frugal_preemptions_total"))
    lines = [f"soak of {args.url}: {args.num_requests} requests, {args.concurrency} in flight, "
             f"{args.disconnect_rate:.0%} disconnects, {args.bad_rate:.0%} bad",
             "| requests | good | good stream | disconnect | bad | 5xx | problems |",
             "|---|---|---|---|---|---|---|",
             f"| {sum(kinds.values())} | {kinds['good']} | {kinds['good stream']} | "
             f"{kinds['disconnect']} | {kinds['bad']} | {server_errors} | "
             f"{len(report.problems)} |",
             f"afterwards: {after}"]
    lines += [f"problem: {p}" for p in report.problems[:20]]
    lines.append(f"command: {command_line()}")
    return "\n".join(lines)
