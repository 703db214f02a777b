"""The HTTP side channel of prefill/decode disaggregation: a prefill worker serves its NIXL
metadata at GET /kv/handshake (on its API port: remote_host and remote_port of the
kv_transfer_params it returns); a decode worker fetches it once per prefill engine and hands it
to its engine with the request (frugal.disagg.nixl_connector checks the two pools' layouts match).

With the deployment's secret (frugal.disagg.signing) the decode worker acts only on hand-offs a
prefill worker signed, each once, before it opens any connection; it proves the secret to the
prefill worker with a token, and takes only an answer signed for the engine it asked about.
The host it connects to comes from the signed params, is an IP address or a host name (nothing
that could reach another path), may be limited to an allow-list (--kv-peers), and gets one GET
with no redirects, a time limit and a size limit. Whatever goes wrong, the client hears one
generic error (a refused port, an HTTP error and a bad answer look alike); the log says which.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import ipaddress
import json
import logging
import re
import socket
import time

from frugal.disagg.signing import SIGNATURE, Rejected, Replays, Signer
from frugal.server.protocol import APIError

logger = logging.getLogger("frugal")

HANDSHAKE_PATH = "/kv/handshake"
AUTH_HEADER = "X-Frugal-KV-Auth"
MAX_REPLY_BYTES = 1 << 20
FAILURE_TTL_S = 5.0  # a peer that failed a handshake is not asked again for this long
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def valid_host(host: object) -> bool:
    """An IP address or a DNS host name: nothing with '/', '@', '?', '#', ':' (outside an IPv6
    address), spaces or control characters."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOSTNAME.fullmatch(host) is not None


def valid_port(port: object) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


def parse_peers(text: str | None) -> set[tuple[str, int]] | None:
    """--kv-peers "host:port,[v6]:port,..." as a set; None when not given. ValueError naming a
    bad entry."""
    if not text:
        return None
    peers = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not valid_host(host) or not port.isdigit() or not valid_port(int(port)):
            raise ValueError(f"kv_peers: {item!r} is not host:port")
        peers.add((host, int(port)))
    return peers


def peer_addresses(peers: set[tuple[str, int]] | None) -> set[str] | None:
    """The IP addresses the hosts of `peers` resolve to (whom a prefill worker serves)."""
    if peers is None:
        return None
    found = set()
    for host, _ in peers:
        for *_, address in socket.getaddrinfo(host, None):
            found.add(str(ipaddress.ip_address(address[0].split("%")[0])))
    return found


def may_handshake(signer: Signer | None, addresses: set[str] | None, token: str | None,
                  client: str | None) -> bool:
    """Whether a prefill worker answers GET /kv/handshake: to a token made with the secret (no
    secret, no answer), from one of the --kv-peers addresses when they are given."""
    try:
        ip = ipaddress.ip_address(client or "")
    except ValueError:
        return False
    if signer is None or addresses is not None and str(ip) not in addresses:
        return False
    return signer.check_token(token, "handshake")


class Peers:
    """Prefill workers' metadata by (host, port, engine id), fetched once each (a restarted
    worker has a new engine id), on a few threads of its own, one fetch per peer at a time."""

    def __init__(self, signer: Signer, allowed: set[tuple[str, int]] | None = None,
                 timeout_s: float = 10.0, max_fetches: int = 4) -> None:
        self.signer, self.allowed, self.timeout_s = signer, allowed, timeout_s
        self._by_peer: dict[tuple[str, int, str], dict] = {}
        self._failed: dict[tuple[str, int, str], float] = {}  # -> when it last failed
        self._inflight: dict[tuple[str, int, str], asyncio.Future] = {}
        self._replays = Replays()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_fetches, "frugal-kv-handshake")

    async def attach(self, params: dict) -> dict:
        """A decode request's kv_transfer_params with the prefill worker's metadata added as
        "peer" (a "peer" the client sent is dropped). APIError 400 for params this worker
        cannot verify or that lack fields, 502 when the prefill worker does not answer as
        one."""
        params = {k: v for k, v in params.items() if k != "peer"}
        if not params.get("do_remote_prefill"):
            return params
        try:  # (in a thread: what a client sent may be as large as the body cap)
            fields = await asyncio.to_thread(self.signer.verify, params)
        except Rejected as e:
            raise APIError(str(e), "kv_transfer_params") from None
        if not self._replays.first(params[SIGNATURE], fields.get("expires_at")):
            raise APIError(str(Rejected()), "kv_transfer_params")
        host, port = params.get("remote_host"), params.get("remote_port")
        engine_id = params.get("remote_engine_id")
        if not valid_host(host) or not valid_port(port) or not isinstance(engine_id, str):
            raise APIError("kv_transfer_params: remote_host (an IP address or host name), "
                           "remote_port and remote_engine_id are required with "
                           "do_remote_prefill", "kv_transfer_params")
        if self.allowed is not None and (host, port) not in self.allowed:
            raise APIError("kv_transfer_params: remote_host:remote_port is not a prefill "
                           "worker this worker reads from (--kv-peers)", "kv_transfer_params")
        return {**params, "peer": await self._metadata((host, port, engine_id))}

    async def _metadata(self, key: tuple[str, int, str]) -> dict:
        meta = self._by_peer.get(key)
        if meta is not None:
            return meta
        unavailable = APIError("kv_transfer_params: the prefill worker's side channel did not "
                               "answer", "kv_transfer_params", status=502, kind="server_error")
        if time.monotonic() - self._failed.get(key, -FAILURE_TTL_S) < FAILURE_TTL_S:
            raise unavailable
        future = self._inflight.get(key)
        if future is None:  # the first asker fetches; the others wait for its answer
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._fetch, *key)
            self._inflight[key] = future
            future.add_done_callback(lambda _: self._inflight.pop(key, None))
        try:
            meta = await asyncio.shield(future)
        except Exception as e:
            now = time.monotonic()
            if len(self._failed) > 1024:  # (keys come from signed params: few, but bounded)
                self._failed = {k: t for k, t in self._failed.items() if now - t < FAILURE_TTL_S}
            self._failed[key] = now
            logger.warning("KV handshake with %s:%d (engine %s) failed: %s", *key, e)
            raise unavailable from None
        self._by_peer[key] = meta
        self._failed.pop(key, None)
        return meta

    def _fetch(self, host: str, port: int, engine_id: str) -> dict:
        """(a pool thread) GET the handshake: one request, no redirects, bounded in time and
        size; the answer verified and about engine_id. Raises on anything else."""
        deadline = time.monotonic() + self.timeout_s
        connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        try:
            connection.request("GET", HANDSHAKE_PATH,
                               headers={AUTH_HEADER: self.signer.token("handshake")})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            body = b""
            while chunk := response.read(65536):
                body += chunk
                if len(body) > MAX_REPLY_BYTES or time.monotonic() > deadline:
                    raise RuntimeError("the answer is too large or too slow")
        finally:
            connection.close()
        meta = json.loads(body)
        if not isinstance(meta, dict):
            raise RuntimeError("the answer is not a JSON object")
        meta = self.signer.verify(meta)
        if meta.get("engine_id") != engine_id:
            raise RuntimeError(f"the answer is about engine {meta.get('engine_id')!r}")
        return meta

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
