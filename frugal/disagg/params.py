"""kv_transfer_params as frugal's workers write and read them: what a prefill worker hands on
(handoff_params) and what a decode worker takes from them (parse_load), every field checked.

The fields are vLLM's NixlConnector's (do_remote_prefill, remote_engine_id, remote_block_ids,
remote_host, remote_port, tp_size) and frugal's own: page_checksums (one per page, over all its
bytes), first_token_id and first_logprob (the token the prefill worker sampled after the prompt;
log-probabilities as their repr: signed fields hold no float, see disagg.signing) and
prompt_sha256. A client never writes them: the decode side acts only on signed params.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from frugal.request import TokenLogprob


@dataclass
class KVLoad:
    """Where a decode request's prompt KV is (parsed from kv_transfer_params)."""

    engine_id: str
    remote_request_id: str
    remote_pages: list[int]
    checksums: list[int]
    first_token: int
    first_logprob: TokenLogprob | None
    where: str
    first_page: int = 0  # pages before this one came from the decode side's prefix cache
    mapped: bool = False  # its read copies from the prefill pool mapped here (disagg.direct)


LOGPROB_FLOOR = -9999.0  # a non-finite log-probability as JSON carries it (as vLLM clamps)
MAX_TOP = 64


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def bad(name: str, what: str) -> ValueError:
    return ValueError(f"kv_transfer_params: {name}: {what}")


def field(params: dict, name: str, kind: type | tuple[type, ...]):
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise bad(name, f"expected {getattr(kind, '__name__', kind)}, got "
                         f"{type(value).__name__}")
    return value


def _int_list(params: dict, name: str, length: int, low: int, high: int) -> list[int]:
    value = field(params, name, list)
    if len(value) != length or any(not isinstance(v, int) or isinstance(v, bool)
                                   or not low <= v < high for v in value):
        raise bad(name, f"expected {length} integers in [{low}, {high}) (one per page of the "
                         "prompt)")
    return value


def _token(value, vocab_size: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
        raise bad(name, "not a token id")
    return value


def _logprob(value, name: str) -> float:
    """A log-probability as hold() writes it: its repr (a float is not carried exactly)."""
    try:
        number = float(value) if isinstance(value, str) and len(value) < 32 else math.nan
    except ValueError:
        number = math.nan
    if math.isnan(number) or number > 0:
        raise bad(name, "not a log-probability")
    return number


def _first_logprob(value, vocab_size: int) -> TokenLogprob | None:
    """The prefill side's first-token log-probability as TokenLogprob; ValueError if malformed."""
    if value is None:
        return None
    name = "first_logprob"
    if not isinstance(value, dict) or not isinstance(value.get("top"), list) \
            or len(value["top"]) > MAX_TOP:
        raise bad(name, "expected {token_id, logprob, top}")
    top = []
    for entry in value["top"]:
        if not isinstance(entry, list) or len(entry) != 2:
            raise bad(name, "top: expected [token_id, logprob] pairs")
        top.append((_token(entry[0], vocab_size, name), _logprob(entry[1], name)))
    return TokenLogprob(_token(value.get("token_id"), vocab_size, name),
                        _logprob(value.get("logprob"), name), top)


def _text(x: float) -> str:
    """A log-probability as a signed field carries it (signing: no floats), finite."""
    return repr(float(x) if math.isfinite(x) else LOGPROB_FLOOR)


def handoff_params(engine_id: str, request_id: str, pages: list[int], checksums: list[int],
                   address: tuple[str, int] | None, first_token: int,
                   logprob: TokenLogprob | None, prompt: list[int]) -> dict:
    """A finished prefill's kv_transfer_params (before signing)."""
    host, port = address if address is not None else (None, None)
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
        "remote_request_id": request_id, "remote_block_ids": pages, "remote_host": host,
        "remote_port": port, "tp_size": 1, "page_checksums": checksums,
        "first_token_id": first_token,
        "first_logprob": None if logprob is None else {
            "token_id": logprob.token_id, "logprob": _text(logprob.logprob),
            "top": [[t, _text(v)] for t, v in logprob.top]},
        "prompt_sha256": prompt_hash(prompt),
    }


def parse_load(fields: dict, engine_id: str, num_pages: int, num_remote_pages: int,
               vocab_size: int, where: str) -> KVLoad:
    """The KVLoad of verified params for a prompt of num_pages pages from a peer whose pool has
    num_remote_pages; ValueError naming the first field that is not what handoff_params
    writes."""
    return KVLoad(engine_id, field(fields, "remote_request_id", str),
                  _int_list(fields, "remote_block_ids", num_pages, 0, num_remote_pages),
                  _int_list(fields, "page_checksums", num_pages, -(1 << 63), 1 << 63),
                  _token(fields.get("first_token_id"), vocab_size, "first_token_id"),
                  _first_logprob(fields.get("first_logprob"), vocab_size), where)
