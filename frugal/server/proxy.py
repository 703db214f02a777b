"""The front of `frugal serve-pd --api-key`: checks each client's key, then relays to vllm-router.

vllm-router (0.1.17) checks no client key, and calls the workers with its own
`Authorization: Bearer $OPENAI_API_KEY` in place of the client's. So a deployment with an API
key runs the router on a loopback port and this relay on the public port: the API-key gate and
the body cap (server.gate), then the request as it came (the OpenAI routes and /health alone),
its answer streamed back as it comes. A client that leaves closes the relayed request, which
aborts it downstream.

    python -m frugal.server.proxy --upstream http://127.0.0.1:8003 --port 8000
    (the key from $FRUGAL_API_KEY)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re

import httpx2  # what the openai client (a runtime dependency) speaks HTTP with

from frugal.server.gate import Gate
from frugal.server.protocol import APIError

# headers of one hop only (RFC 9110 7.6.1); of a request, also what the relay sets itself
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
        b"transfer-encoding", b"upgrade"}
_DROPPED = _HOP | {b"host", b"authorization", b"content-length"}
ROUTES = re.compile(r"/v1/[A-Za-z0-9_/-]+|/health")  # (no dots: no "/v1/../kv")


class Relay:
    """An ASGI app that sends each HTTP request to upstream and streams the answer back."""

    def __init__(self, upstream: str) -> None:
        self.client = httpx2.AsyncClient(base_url=upstream, follow_redirects=False,
                                         timeout=httpx2.Timeout(None, connect=10.0))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.client.aclose()
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:  # (the gate has capped it)
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope.get("raw_path", b"").decode("latin-1") or scope["path"]
        if not ROUTES.fullmatch(path):
            return await _error(send, APIError(f"{path[:100]}: not found", status=404))
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        named = {n.strip().lower().encode() for k, v in scope["headers"] if k.lower() ==
                 b"connection" for n in v.decode("latin-1").split(",")}  # hop-by-hop too
        headers = [(k, v) for k, v in scope["headers"]
                   if k.lower() not in _DROPPED and k.lower() not in named]
        if not any(k.lower() == b"accept-encoding" for k, _ in headers):  # (httpx's: gzip)
            headers.append((b"accept-encoding", b"identity"))
        relay = asyncio.create_task(self._relay(scope["method"], path, body, headers, send))
        left = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({relay, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, left):
                task.cancel()
            await asyncio.gather(relay, left, return_exceptions=True)

    async def _relay(self, method: str, path: str, body: bytes, headers: list, send) -> None:
        """Send the request on and stream its answer back (cancelled when the client leaves:
        the upstream request is closed with it)."""
        try:
            request = self.client.build_request(method, path, content=body, headers=headers)
            response = await self.client.send(request, stream=True)
        except Exception:  # (an unreachable router, or a path httpx cannot send)
            return await _error(send, APIError("the router behind this server does not answer",
                                               status=502, kind="server_error"))
        try:
            await self._stream(response, send)
        finally:
            await response.aclose()

    async def _stream(self, response: httpx2.Response, send) -> None:
        headers = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in response.headers.multi_items()
                   if k.lower().encode("latin-1") not in _HOP]
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _error(send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    key = os.environ.get("FRUGAL_API_KEY")
    if not key:
        p.error("the API key comes from $FRUGAL_API_KEY")
    app = Gate(Relay(args.upstream), api_key=key, max_request_bytes=args.max_request_bytes,
               exempt_prefixes=())
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
