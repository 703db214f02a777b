"""What every HTTP request passes before a route sees it: the API key and the body size cap.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
runs the route in a task of its own behind a stream, so `request.is_disconnected()` never sees
the client leave and a non-streaming request whose client is gone would run to its end.
"""

from __future__ import annotations

import hmac
import json

from frugal.server.protocol import APIError

# Paths under these prefixes skip the API key: /kv/* is the prefill/decode side channel, which
# workers call without the client's key and which carries its own secret (side_channel).
KEY_EXEMPT_PREFIXES = ("/kv/",)


class Gate:
    """The API key (when one is set) on every path but `public_paths` and those under
    `exempt_prefixes`, and at most max_request_bytes of body.

    Unknown paths need the key too, so a client without it cannot learn which routes exist.
    Paths are compared as the server received them (no normalizing): "/health/" is not public.
    A body over the cap is refused with a 413 from its Content-Length alone, or as soon as the
    bytes read pass the cap, before anything parses or tokenizes it; the app then gets the body
    in one piece (and, after it, the client's disconnect message as usual).
    """

    def __init__(self, app, api_key: str | None, max_request_bytes: int | None,
                 public_paths: frozenset[str] = frozenset({"/health"}),
                 exempt_prefixes: tuple[str, ...] = KEY_EXEMPT_PREFIXES) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_request_bytes = max_request_bytes
        self.public_paths = public_paths
        self.exempt_prefixes = exempt_prefixes

    def needs_key(self, path: str) -> bool:
        return (self.expected is not None and path not in self.public_paths
                and not path.startswith(self.exempt_prefixes))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.needs_key(scope["path"]):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _refuse(send, APIError("invalid or missing API key", status=401,
                                                    code="invalid_api_key"))
        cap = self.max_request_bytes
        if cap is None:
            return await self.app(scope, receive, send)
        too_big = APIError(f"body: larger than the server's limit of {cap} bytes "
                           "(--max-request-bytes)", status=413, code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            return await _refuse(send, too_big)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > cap:
                return await _refuse(send, too_big)
            more = message.get("more_body", False)
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)


async def _refuse(send, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
