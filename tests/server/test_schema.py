"""schemathesis against /openapi.json: generated requests, valid and not, at every route get no
server error, and every answer matches what the schema documents (the OpenAI error body of a
4xx included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import start_server, stop_server

pytest.importorskip("schemathesis")


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(tmp_path):
    s = start_server(tmp_path / "serve.log", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                     "--max-model-len", "32", "--log-level", "WARNING")
    try:
        status, schema = s.request("GET", "/openapi.json")
        assert status == 200
        error = schema["paths"]["/v1/completions"]["post"]["responses"]["400"]
        assert error["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
        # Default checks, but positive_data_acceptance: the schema cannot say that a prompt must
        # fit the context or that max_tokens must fit after it, so some schema-valid requests
        # get their documented 400.
        r = subprocess.run(
            [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
             "run", s.url + "/openapi.json", "--max-examples", "20", "--seed", "1",
             "--exclude-checks", "positive_data_acceptance", "--no-color",
             "--request-timeout", "60"],  # (a generation to the 32-token context on 2 busy cores)
            capture_output=True, text=True, timeout=1200, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        assert "passed" in r.stdout and "failures" not in r.stdout.split("SUMMARY")[-1]
    finally:
        assert stop_server(s) == 0, s.output()
