"""`frugal bench soak` against the live server: 200 requests, 64 in flight, 20 % of clients
disconnecting, 5 % bad requests; no unexpected error, no 5xx, idle and whole afterwards (the
1,000-request run of docs/reliability.md is the same command with more requests)."""

from __future__ import annotations

import subprocess
import sys

from tests.server.conftest import API_KEY


def test_soak_200_requests_leaves_the_server_idle_and_whole(server):
    r = subprocess.run([sys.executable, "-m", "frugal.cli.main", "bench", "soak", "--url",
                        server.url, "--api-key", API_KEY, "--num-requests", "200",
                        "--concurrency", "64", "--max-prompt-len", "128", "--max-tokens", "16"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| 200 |" in r.stdout and "problem" not in r.stdout.replace("| problems |", "")
    assert "bookkeeping_checks_total=0" not in r.stdout
