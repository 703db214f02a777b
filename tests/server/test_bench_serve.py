"""`frugal bench serve` against the live test server: every request completes and the latency
statistics are consistent; a dead server is a failure, not a hang."""

import json
import subprocess
import sys

from tests.server.conftest import API_KEY, free_port


def bench_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frugal.cli.main", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=600)


def test_bench_serve_reports_every_request(server, tmp_path):
    out = tmp_path / "serve.json"
    r = bench_serve("--url", server.url, "--api-key", API_KEY, "--concurrency", "1,3",
                    "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                    "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "| 3 | 6 | 0 |" in r.stdout and "command: frugal bench serve" in r.stdout
    results = json.loads(out.read_text())["results"]
    for row in results:
        assert row["completed"] == 6 and row["failed"] == 0
        assert abs(row["output_tok_s"] * row["duration_s"] - 6 * 8) < 1e-6
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            mean, median, p99 = row[key]
            assert 0 <= median <= p99 and mean > 0


def test_bench_serve_without_a_server_fails_cleanly():
    r = bench_serve("--url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2",
                    "--concurrency", "1")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "error" in r.stderr.lower()


def test_bench_serve_names_what_is_wrong(server):
    r = bench_serve("--url", server.url, "--api-key", "wrong", "--num-prompts", "1")
    assert r.returncode == 2 and "HTTP 401" in r.stderr and "Traceback" not in r.stderr
    r = bench_serve("--url", server.url, "--concurrency", "1,0")
    assert r.returncode == 2 and "concurrency" in r.stderr


def test_bench_serve_reports_the_prefix_cache_hit_rate(server, tmp_path):
    """A shared 32-token prefix and 8 tokens each: the two full pages of the prefix hit (the
    warm-up request computed them), the partial third does not: 32 of 40 prompt tokens."""
    out = tmp_path / "prefix.json"
    r = bench_serve("--url", server.url, "--api-key", API_KEY, "--concurrency", "1,3",
                    "--num-prompts", "6", "--prefix-len", "32", "--input-len", "8",
                    "--output-len", "4", "--seed", "7", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "32 shared + 8 in" in r.stdout and "cache hit %" in r.stdout
    for row in json.loads(out.read_text())["results"]:
        assert row["prefix_hit_rate"] == 32 / 40


def test_bench_serve_mixed_workload_sends_long_prompts_beside(server, tmp_path):
    """--long-input-len/--long-rate: long prompts arrive at their rate while the measured
    requests run (about duration x rate of them, each answered), reported apart."""
    out = tmp_path / "mixed.json"
    r = bench_serve("--url", server.url, "--api-key", API_KEY, "--concurrency", "2",
                    "--num-prompts", "4", "--input-len", "8", "--output-len", "16",
                    "--long-input-len", "48", "--long-rate", "8", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert "long prompts (48 in / 1 out, 8 a second" in r.stdout
    row = json.loads(out.read_text())["results"][0]
    assert row["completed"] == 4 and row["failed"] == 0 and row["long_failed"] == 0
    assert 1 <= row["long_completed"] <= row["duration_s"] * 8 + 1
    assert 0 < row["long_ttft_ms"][1] <= row["long_ttft_ms"][2]
    r = bench_serve("--url", server.url, "--long-input-len", "200")
    assert r.returncode == 2 and "long_rate" in r.stderr
