"""The deployment's shared secret: signed hand-offs and an authenticated side channel.

Every worker of one prefill/decode deployment holds the same secret (`--kv-secret`,
`$FRUGAL_KV_SECRET`; `frugal serve-pd` makes one). With it:
- a prefill worker signs the kv_transfer_params it returns (an HMAC-SHA256 over every field,
  the expiry included), and a decode worker acts only on params whose signature it can check,
  so a client can neither make them up nor change one page id, host or checksum in them;
- a decode worker proves it holds the secret when it asks for a prefill worker's NIXL metadata
  (a token: a timestamp and an HMAC of it), and the prefill worker signs its answer.

Signatures are over the canonical JSON of the fields (sorted keys, no spaces), so params that
went through vllm-router (which parses and re-serializes them) still verify. That holds for
strings, integers (to 64 bits), booleans and null, not for floats, which vllm-router's JSON
parser may move by an ulp: signed fields hold no float (a log-probability travels as its repr,
a time as whole seconds). Nothing here says why a check failed beyond "not valid": a client
learns nothing from the refusal.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time

SIGNATURE = "frugal_signature"  # the field that carries a signature
EXPIRES = "expires_at"  # wall-clock seconds (time.time) after which a hand-off is refused
TOKEN_WINDOW_S = 60.0  # a side-channel token is good this long either side of its timestamp
MIN_SECRET_CHARS = 16


REJECTED = "kv_transfer_params: not a valid hand-off from a prefill worker of this deployment"


class Rejected(ValueError):
    """Params that do not carry a valid signature, have expired or were used before (the
    message says no more)."""

    def __init__(self, message: str = REJECTED) -> None:
        super().__init__(message)


MAX_DEPTH = 6  # of nested lists and objects in signed fields (a hand-off has 4)
MAX_ITEMS = 1 << 18  # values in all (2 per page of a prompt, and a few)


def canonical(fields: dict) -> bytes:
    """The bytes a signature covers; TypeError for a float anywhere (see the module docstring)
    or for fields deeper or larger than any hand-off (MAX_DEPTH, MAX_ITEMS), checked before
    anything is encoded."""
    _check_shape(fields)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _check_shape(fields: dict) -> None:
    stack, count = [(fields, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if isinstance(value, float) or depth > MAX_DEPTH or count > MAX_ITEMS:
            raise TypeError("signed fields hold a float, or are deeper or larger than any "
                            "hand-off")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


class Signer:
    """HMAC-SHA256 under one secret. Stateless and thread-safe."""

    def __init__(self, secret: str) -> None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"kv_secret: at least {MIN_SECRET_CHARS} characters (e.g. "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        self._key = hashlib.sha256(b"frugal-kv\0" + secret.encode()).digest()

    def _mac(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def sign(self, fields: dict, ttl_s: float | None = None) -> dict:
        """fields with an expiry (ttl_s from now, if given) and a signature added."""
        fields = {k: v for k, v in fields.items() if k != SIGNATURE}
        if ttl_s is not None:
            fields[EXPIRES] = math.ceil(time.time() + ttl_s)
        return {**fields, SIGNATURE: self._mac(canonical(fields))}

    def verify(self, signed: dict, now: float | None = None) -> dict:
        """The fields of `signed` without the signature; Rejected unless it was signed with this
        secret and (where it has an expiry) has not expired."""
        if not isinstance(signed, dict) or not isinstance(signed.get(SIGNATURE), str):
            raise Rejected()
        fields = {k: v for k, v in signed.items() if k != SIGNATURE}
        try:
            mac = self._mac(canonical(fields))
        except (TypeError, ValueError):
            raise Rejected() from None
        if not hmac.compare_digest(mac, signed[SIGNATURE]):
            raise Rejected()
        expires = fields.get(EXPIRES)
        if expires is not None and (not isinstance(expires, int) or isinstance(expires, bool)
                                    or (time.time() if now is None else now) > expires):
            raise Rejected()
        return fields

    def token(self, purpose: str, now: float | None = None) -> str:
        """A proof of the secret for one kind of side-channel request: "<time>.<hmac>"."""
        stamp = f"{time.time() if now is None else now:.3f}"
        return f"{stamp}.{self._mac(f'{purpose}|{stamp}'.encode())}"

    def check_token(self, token: str | None, purpose: str, now: float | None = None) -> bool:
        """Whether token came from token(purpose) under this secret within TOKEN_WINDOW_S."""
        if not isinstance(token, str) or token.count(".") != 2:
            return False
        stamp, _, mac = token.rpartition(".")
        try:
            age = abs((time.time() if now is None else now) - float(stamp))
        except ValueError:
            return False
        return age <= TOKEN_WINDOW_S and hmac.compare_digest(
            mac, self._mac(f"{purpose}|{stamp}".encode()))


class Replays:
    """Hand-offs seen, until they expire: a signed hand-off is acted on once. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}  # a hand-off's signature -> its expiry
        self._prune_at = 1024  # entries; doubled after a prune that keeps most (amortized O(1))
        self._lock = threading.Lock()

    def first(self, key: str, expires: float | None) -> bool:
        """True the first time key is offered (remembered until `expires`), False after."""
        now = time.time()
        with self._lock:
            if len(self._seen) > self._prune_at:
                self._seen = {k: t for k, t in self._seen.items() if t > now}
                self._prune_at = max(1024, 2 * len(self._seen))
            if key in self._seen and self._seen[key] > now:
                return False
            self._seen[key] = expires if isinstance(expires, int) else now + 3600.0
            return True
