"""A client that stops reading a 4,096-token stream (16 choices of 256 tokens) costs the server no
memory to speak of: what it has not read waits joined in one output per choice (not a queue of
cumulative copies)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.server.conftest import MODEL, metrics, start_server, stop_server
from tests.server.test_hostile import raw_post, read_all

# 4,096 tokens in all, batched. The joining itself is tested on the engine
# (tests/engine/test_async_engine.py); here the server's RSS end to end, against gross growth
NUM_CHOICES, NUM_TOKENS = 16, 256
STALL_S = 10.0
MAX_GROWTH_BYTES = 50 * 2**20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_reader_that_stalls_for_a_4096_token_stream_leaves_rss_flat(tmp_path):
    s = start_server(tmp_path / "serve.log", "--kv-cache-memory", "256MiB", "--log-level",
                     "WARNING")
    try:
        # top-20 log-probabilities make each event ~1.5 KB: the stream (~6 MB) outgrows the
        # sockets' buffers, so the server really holds what the reader does not take
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count:"}],
                "max_tokens": NUM_TOKENS, "n": NUM_CHOICES, "ignore_eos": True, "logprobs": True,
                "top_logprobs": 20, "stream": True, "stream_options": {"include_usage": True}}
        read_all(raw_post(s.url, "/v1/chat/completions", {**body, "max_tokens": 64}))  # warm up
        idle = rss_bytes(s.process.pid)
        sock = raw_post(s.url, "/v1/chat/completions", body, rcvbuf=4096)
        sock.recv(64)  # the stream has begun; nothing more is read for a while
        start, peak = time.monotonic(), idle
        while time.monotonic() - start < STALL_S or metrics(s)["frugal_num_requests_running"]:
            peak = max(peak, rss_bytes(s.process.pid))
            time.sleep(1.0)
        generated = metrics(s)["frugal_generation_tokens_total"]
        assert generated >= 64 + NUM_CHOICES * NUM_TOKENS  # all of it waited for the reader
        print(f"RSS idle {idle / 2**20:.0f} MiB, peak while stalled {peak / 2**20:.0f} MiB")
        assert peak - idle < MAX_GROWTH_BYTES, (idle, peak)
        events = [line for line in read_all(sock, 120).split(b"\n") if line.startswith(b"data:")]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == (
            NUM_CHOICES * NUM_TOKENS)
    finally:
        assert stop_server(s) == 0, s.output()
