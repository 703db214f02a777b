"""schemathesis against /openapi.json: generated requests, valid and not, at every route get no
server error, and every answer matches what the schema documents (the OpenAI error body of a
4xx included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import MODEL, start_server, stop_server

pytest.importorskip("schemathesis")


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(tmp_path):
    s = start_server(tmp_path / "serve.log", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                     "--max-model-len", "40", "--log-level", "WARNING")
    try:
        status, schema = s.request("GET", "/openapi.json")
        assert status == 200
        error = schema["paths"]["/v1/completions"]["post"]["responses"]["400"]
        assert error["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
        # 40 tokens (short generations keep the run short) leave room for short chats after the
        # chat template's ~30: their successful answers are checked too
        status, _ = s.request("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 4})
        assert status == 200
        # Default checks, but positive_data_acceptance: the schema cannot say that a prompt must
        # fit the context or that max_tokens must fit after it, so some schema-valid requests
        # get their documented 400.
        r = subprocess.run(
            [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
             "run", s.url + "/openapi.json", "--max-examples", "20", "--seed", "1",
             "--exclude-checks", "positive_data_acceptance", "--no-color",
             "--request-timeout", "60"],  # (a generation to the 40-token context on 2 busy cores)
            capture_output=True, text=True, timeout=1200, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        assert "passed" in r.stdout and "failures" not in r.stdout.split("SUMMARY")[-1]
    finally:
        assert stop_server(s) == 0, s.output()
