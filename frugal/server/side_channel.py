"""The HTTP side channel of prefill/decode disaggregation: a prefill worker serves its NIXL
metadata at GET /kv/handshake (on its API port: remote_host and remote_port of the
kv_transfer_params it returns); a decode worker fetches it once per prefill engine and hands it
to its engine with the request (frugal.disagg.handoff checks the two pools' layouts match)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from frugal.server.protocol import APIError

HANDSHAKE_PATH = "/kv/handshake"


class Peers:
    """Prefill workers' metadata by engine id (a restarted worker has a new id)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._by_engine: dict[str, dict] = {}

    async def attach(self, params: dict) -> dict:
        """A decode request's kv_transfer_params with the prefill worker's metadata added as
        "peer"; other params unchanged. APIError 400 for missing fields, 502 when the prefill
        worker does not answer."""
        if not params.get("do_remote_prefill"):
            return params
        host, port = params.get("remote_host"), params.get("remote_port")
        engine_id = params.get("remote_engine_id")
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(engine_id,
                                                                                   str):
            raise APIError("kv_transfer_params: remote_host, remote_port and remote_engine_id "
                           "are required with do_remote_prefill", "kv_transfer_params")
        meta = self._by_engine.get(engine_id)
        if meta is None:
            url = f"http://{host}:{port}{HANDSHAKE_PATH}"
            try:
                meta = await asyncio.to_thread(self._fetch, url)
            except Exception as e:
                raise APIError(f"kv_transfer_params: the prefill worker's side channel {url} "
                               f"does not answer: {e}", "kv_transfer_params", status=502,
                               kind="server_error") from e
            self._by_engine[meta["engine_id"]] = meta
        return {**params, "peer": meta}

    def _fetch(self, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
            return json.loads(response.read())
