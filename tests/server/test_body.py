"""Request bodies parsed and validated on a pool thread (server.body): what json.loads and FastAPI
took is taken, what they refused is a 400 with the field's name or invalid_json."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError

from frugal.server.body import parse
from frugal.server.protocol import CompletionRequest, DetokenizeRequest
from tests.server.conftest import MODEL


def error_of(model, body: bytes) -> dict:
    with pytest.raises(RequestValidationError) as e:
        parse(model, body)
    return e.value.errors()[0]


def test_a_body_parses_into_its_model():
    assert parse(DetokenizeRequest, b'{"tokens": [1, 2]}').tokens == [1, 2]


def test_what_only_json_loads_takes_reaches_the_fields_checks():
    """pydantic_core refuses a lone surrogate escape and nesting past 200; json.loads takes both,
    and the fields answer them."""
    error = error_of(CompletionRequest, b'{"model": "m", "prompt": "\\ud800"}')
    assert error["loc"] == ("body", "prompt", "str") and error["type"] == "invalid_unicode"
    deep = b'{"model": "m", "prompt": "x", "kv_transfer_params": ' + b"[" * 300 + b"]" * 300
    error = error_of(CompletionRequest, deep + b"}")
    assert error["loc"][:2] == ("body", "kv_transfer_params")


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"tokens": [1,', b"\xff\xfe{}"])
def test_json_that_no_parser_takes_is_invalid_json(body):
    assert error_of(DetokenizeRequest, body)["type"] == "json_invalid"


def test_an_empty_body_is_a_missing_field():
    assert error_of(DetokenizeRequest, b"")["type"] == "missing"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_400(server, content_type):
    """FastAPI's rule, with a message that says what to send."""
    import http.client
    import json
    from urllib.parse import urlsplit

    from tests.server.conftest import API_KEY
    url = urlsplit(server.url)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi"}),
                     headers)
        answer = conn.getresponse()
        status, err = answer.status, json.loads(answer.read())
    finally:
        conn.close()
    assert status == 400 and "Content-Type: application/json" in err["error"]["message"], err


def test_deep_nesting_is_invalid_json(server):
    status, err = server.request("POST", "/v1/completions", b"[" * 100_000)
    assert status == 400 and err["error"]["code"] == "invalid_json", err


def test_a_client_that_leaves_mid_body_gets_a_400_and_nothing_is_logged():
    """Without a body cap (library use: the Gate then passes the body through) the app reads
    the body itself; a disconnect there was a 500 and a logged ClientDisconnect."""
    import asyncio
    from types import SimpleNamespace

    from frugal.disagg.connector import NullConnector
    from frugal.server.openai_api import build_app

    engine = SimpleNamespace(tokenizer=None, max_model_len=16, connector=NullConnector())
    app, sent = build_app(engine, MODEL), []
    messages = iter([{"type": "http.request", "body": b'{"model"', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "http_version": "1.1",
             "headers": [(b"content-type", b"application/json")], "scheme": "http",
             "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    asyncio.run(app(scope, receive, send))  # (raises if the app re-raises the disconnect)
    assert sent[0]["status"] == 400
