"""The decode side of the KV side channel (server.side_channel.Peers) against listeners of the
test's own on 127.0.0.1: it connects only where a signed hand-off points, to an IP address or
a host name within --kv-peers, follows no redirect, takes only a signed answer about the engine
it asked for, says one generic thing whatever went wrong, and a bad answer does not stay."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from frugal.disagg.signing import SIGNATURE, Signer
from frugal.server.protocol import APIError
from frugal.server.side_channel import (
    AUTH_HEADER,
    HANDSHAKE_PATH,
    Peers,
    may_handshake,
    parse_peers,
    valid_host,
)

SIGNER = Signer("test-secret-of-this-deployment")
META = {"engine_id": "frugal-real", "num_pages": 4, "layout": {}}


class Listener:
    """An HTTP server on a free port that records each request and answers with `reply`:
    (status, headers, body)."""

    def __init__(self, reply) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.reply = reply
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                listener.seen.append((self.path, dict(self.headers)))
                status, headers, body = listener.reply(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def signed_meta(meta: dict = META):
    return lambda handler: (200, {"Content-Type": "application/json"},
                            json.dumps(SIGNER.sign(meta)).encode())


@pytest.fixture
def listener():
    made = []

    def make(reply=None):
        made.append(Listener(reply or signed_meta()))
        return made[-1]

    yield make
    for one in made:
        one.close()


def handoff(port: int, host: str = "127.0.0.1", engine_id: str = "frugal-real", **more) -> dict:
    return SIGNER.sign({"do_remote_prefill": True, "remote_engine_id": engine_id,
                        "remote_request_id": f"r{time.monotonic_ns()}", "remote_host": host,
                        "remote_port": port, **more}, ttl_s=30)


def attach(peers: Peers, params: dict) -> dict:
    return asyncio.run(peers.attach(params))


def test_a_signed_handoff_gets_the_signed_metadata_with_a_token(listener):
    one = listener()
    got = attach(Peers(SIGNER), {**handoff(one.port), "peer": {"engine_id": "evil"}})
    assert got["peer"]["engine_id"] == "frugal-real" and SIGNATURE not in got["peer"]
    path, headers = one.seen[0]
    assert path == HANDSHAKE_PATH and SIGNER.check_token(headers[AUTH_HEADER], "handshake")


@pytest.mark.parametrize("change", [
    {"remote_host": "127.0.0.1:52555/internal/admin?delete=1&x="},
    {"remote_port": 1},
    {"remote_engine_id": "frugal-other"},
    {SIGNATURE: "0" * 64},
], ids=["path-injection", "other-port", "other-engine", "forged"])
def test_a_client_cannot_point_the_decode_worker_anywhere(listener, change):
    """Params altered after signing are refused with a 400 and no connection is made."""
    one = listener()
    with pytest.raises(APIError) as e:
        attach(Peers(SIGNER), {**handoff(one.port), **change})
    assert e.value.status == 400 and "not a valid hand-off" in e.value.message
    assert one.seen == []


def test_hosts_that_could_reach_another_path_are_refused_even_signed(listener):
    one = listener()
    for host in ("127.0.0.1:1/x?", "a@b", "x#y", "x y", "h\x00", "", "a/b"):
        assert not valid_host(host)
        with pytest.raises(APIError) as e:
            attach(Peers(SIGNER), handoff(one.port, host=host))
        assert e.value.status == 400
    assert one.seen == []
    assert all(valid_host(h) for h in ("127.0.0.1", "::1", "prefill-0.svc.local", "node7"))


def test_replayed_and_expired_handoffs_are_refused_before_any_connection(listener):
    one = listener()
    peers = Peers(SIGNER)
    params = handoff(one.port)
    attach(peers, params)
    assert len(one.seen) == 1
    expired = {**params, "expires_at": int(time.time()) - 1}
    for bad in (params, SIGNER.sign(expired)):
        with pytest.raises(APIError) as e:
            attach(peers, bad)
        assert e.value.status == 400
    assert len(one.seen) == 1


def test_only_allowed_peers_are_asked(listener):
    one, other = listener(), listener()
    peers = Peers(SIGNER, allowed=parse_peers(f"127.0.0.1:{one.port}"))
    attach(peers, handoff(one.port))
    with pytest.raises(APIError, match="--kv-peers") as e:
        attach(peers, handoff(other.port))
    assert e.value.status == 400 and other.seen == []


def test_no_redirect_is_followed_and_every_failure_reads_the_same(listener):
    target = listener()
    redirect = listener(lambda h: (302, {"Location": f"http://127.0.0.1:{target.port}/"}, b""))
    not_json = listener(lambda h: (200, {}, b"<html>"))
    http_error = listener(lambda h: (500, {}, b"{}"))
    unsigned = listener(lambda h: (200, {}, json.dumps(META).encode()))
    not_object = listener(lambda h: (200, {}, b"[1, 2]"))
    closed = listener()
    closed.close()
    messages = set()
    for one in (redirect, not_json, http_error, unsigned, not_object, closed):
        with pytest.raises(APIError) as e:
            attach(Peers(SIGNER), handoff(one.port))
        assert e.value.status == 502
        messages.add(e.value.message)
    assert target.seen == [] and len(messages) == 1


def test_an_answer_for_another_engine_does_not_poison_the_real_one(listener):
    """A listener answering (signed, even) about another engine fails that request alone; the
    real engine's next hand-off is served."""
    rogue = listener(signed_meta({**META, "engine_id": "frugal-rogue", "num_pages": 100_000}))
    real = listener()
    peers = Peers(SIGNER)
    with pytest.raises(APIError) as e:
        attach(peers, handoff(rogue.port))
    assert e.value.status == 502
    assert attach(peers, handoff(real.port))["peer"]["engine_id"] == "frugal-real"


def test_a_failed_peer_is_not_asked_again_at_once_and_one_fetch_serves_many(listener):
    gate = threading.Event()

    def slow(handler):
        gate.wait(5)
        return signed_meta()(handler)

    one = listener(slow)
    peers = Peers(SIGNER)

    async def many():
        tasks = [asyncio.create_task(peers.attach(handoff(one.port))) for _ in range(8)]
        await asyncio.sleep(0.2)
        gate.set()
        return await asyncio.gather(*tasks)

    assert len(asyncio.run(many())) == 8 and len(one.seen) == 1
    broken = listener(lambda h: (500, {}, b""))
    for _ in range(3):
        with pytest.raises(APIError):
            attach(peers, handoff(broken.port))
    assert len(broken.seen) == 1


def test_the_prefill_side_answers_only_a_token_of_the_secret():
    token = SIGNER.token("handshake")
    assert may_handshake(SIGNER, None, token, "10.1.2.3")
    assert not may_handshake(SIGNER, None, None, "127.0.0.1")
    assert not may_handshake(SIGNER, None, Signer("another-secret-entirely").token("handshake"),
                             "127.0.0.1")
    assert not may_handshake(SIGNER, None, SIGNER.token("handshake", now=time.time() - 120),
                             "127.0.0.1")
    assert not may_handshake(SIGNER, {"10.0.0.9"}, token, "10.1.2.3")
    assert not may_handshake(None, None, None, "127.0.0.1")  # no secret, no answer


def test_what_vllm_router_does_to_json_numbers_does_not_break_a_signature():
    """vllm-router (serde_json) re-serializes the params: integers and strings come back as they
    were, floats may move by an ulp (-1.6685309410095215 came back as -1.6685309410095217), so
    no signed field is a float."""
    signed = SIGNER.sign({"page_checksums": [-(2**63), 2**63 - 1], "logprob": "-1.66853"},
                         ttl_s=30)
    assert isinstance(signed["expires_at"], int)
    assert SIGNER.verify(json.loads(json.dumps(signed)))
    with pytest.raises(TypeError):
        SIGNER.sign({"logprob": -1.6685309410095215})
    moved = {**signed, "logprob": -1.6685309410095217}
    with pytest.raises(ValueError, match="not a valid hand-off"):
        SIGNER.verify(moved)


def test_signed_fields_deeper_or_larger_than_a_handoff_are_refused_not_a_500():
    deep: list = []
    for _ in range(2000):
        deep = [deep]
    for fields in ({"x": deep}, {"x": list(range(1 << 19))}):
        with pytest.raises(ValueError, match="not a valid hand-off"):
            SIGNER.verify({**fields, SIGNATURE: "0" * 64})
