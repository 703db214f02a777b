"""Keys on every endpoint, and every error a client causes is a 4xx OpenAI body (a bug in a route
a JSON 500); nothing a client sends goes out as JSON no client parses."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL, metrics, start_server, stop_server

UNDOCUMENTED = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
                ("GET", "/docs/oauth2-redirect"), ("GET", "/nothing"), ("POST", "/v1/nothing")]


def test_every_endpoint_but_health_needs_the_key(server):
    """Unknown paths included, so a client without the key cannot tell which routes exist."""
    schema = server.request("GET", "/openapi.json")[1]
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    assert ("POST", "/tokenize") in routes and ("GET", "/metrics") in routes
    for method, path in routes + UNDOCUMENTED:
        if path == "/health":
            continue
        status, body = server.request(method, path, b"{}" if method == "POST" else None,
                                      key=None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path)
    assert server.request("GET", "/health", key=None)[0] == 200
    # the side channel's paths have a secret of their own, not the API key
    status, body = server.request("GET", "/kv/handshake", key=None)
    assert body["error"]["code"] != "invalid_api_key", (status, body)


def test_metrics_public_opens_metrics_alone(tmp_path):
    s = start_server(tmp_path / "serve.log", "--kv-cache-memory", "64MiB", "--api-key", "k",
                     "--metrics-public", "--log-level", "WARNING")
    try:
        assert "frugal_num_requests_running" in metrics(s, key=None)
        assert s.request("GET", "/tokenizer_info", key=None)[0] == 401
        assert s.request("GET", "/tokenizer_info", key="k")[0] == 200
    finally:
        assert stop_server(s) == 0, s.output()


KV = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": %s}'


@pytest.mark.parametrize("params", [
    b'{"do_remote_decode": false, "x": NaN}', b'{"first_logprob": {"top": [[1, -Infinity]]}}',
    b'{"remote_host": "\\ud800"}', b'{"\\udc00": null}', b'{"a": [[{"b": Infinity}]]}'])
def test_nan_or_a_lone_surrogate_in_kv_transfer_params_is_400(server, params):
    """Checked before anything reads the params (this worker has no --kv-role, and the params
    ask for no transfer, so before this they were ignored: nothing stops a relay from echoing
    them)."""
    status, err = server.request("POST", "/v1/completions", KV % (MODEL.encode(), params))
    assert status == 400 and err["error"]["param"] == "kv_transfer_params", err
    assert set(err["error"]) == {"message", "type", "param", "code"}


def test_an_unexpected_error_in_a_route_is_a_json_500():
    """Starlette answered an exception no handler knows with a plain-text 500."""
    import asyncio
    from types import SimpleNamespace

    from frugal.disagg.connector import NullConnector
    from frugal.server.openai_api import build_app

    def stats():
        raise RuntimeError("a bug")

    engine = SimpleNamespace(tokenizer=None, max_model_len=16, stats=stats,
                             connector=NullConnector())
    app, sent = build_app(engine, MODEL), []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "raw_path": b"/v1/models",
             "query_string": b"", "headers": [], "http_version": "1.1", "scheme": "http",
             "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    with pytest.raises(RuntimeError, match="a bug"):  # re-raised after the answer, to be logged
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 500
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]


def test_non_finite_logprobs_go_out_as_vllm_sends_them():
    """JSON has no NaN or -Infinity: JSONResponse refused them (a 500), a stream sent a token no
    client parses. vLLM sends -inf as -9999.0; NaN goes out the same."""
    from starlette.responses import JSONResponse

    from frugal.request import TokenLogprob
    from frugal.server.logprobs import chat_entries, completion_logprobs

    inf, nan = float("inf"), float("nan")
    entries = [TokenLogprob(5, -inf, [(5, -inf), (6, nan)]), TokenLogprob(7, nan, [(7, nan)])]
    legacy = completion_logprobs(None, [5, 7], entries)
    chat = chat_entries(None, entries)
    JSONResponse({"legacy": legacy, "chat": chat})  # encodes: no ValueError
    assert legacy["token_logprobs"] == [-9999.0, -9999.0]
    assert legacy["top_logprobs"] == [{"<5>": -9999.0, "<6>": -9999.0}, {"<7>": -9999.0}]
    assert [e["logprob"] for e in chat] == [-9999.0, -9999.0]
    assert [t["logprob"] for e in chat for t in e["top_logprobs"]] == [-9999.0] * 3
    assert completion_logprobs(None, [5], [TokenLogprob(5, -0.25, [(5, -0.25)])])[
        "token_logprobs"] == [-0.25]
