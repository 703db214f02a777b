"""Log-probabilities in the two OpenAI shapes: legacy completions and chat.

Every logprob leaves through `finite`: JSON has no -Infinity or NaN (the response would fail to
encode, a 500, or a stream would carry a token no client parses), so they go out as vLLM sends
-inf, -9999.0.
"""

from __future__ import annotations

import math

from frugal.request import TokenLogprob
from frugal.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # vLLM's value for a logprob of -inf


def finite(logprob: float) -> float:
    """logprob as JSON can carry it: -inf and NaN -> MIN_LOGPROB, +inf (impossible for a
    log-probability, but a broken model could make one) -> 0.0."""
    if math.isfinite(logprob):
        return max(logprob, MIN_LOGPROB)
    return 0.0 if logprob > 0 else MIN_LOGPROB


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """One token as text (a lone piece of a multi-byte character decodes to U+FFFD)."""
    if tokenizer is None:
        return f"<{token_id}>"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer | None, token_ids: list[int],
                        entries: list[TokenLogprob | None]) -> dict:
    """{'tokens', 'token_logprobs', 'top_logprobs', 'text_offset'}, one entry per token.

    An entry of None (the first prompt token under echo) gives a null logprob and top_logprobs.
    top_logprobs maps token text to logprob for the top alternatives plus the token itself.
    """
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(finite(entry.logprob))
        top = {token_text(tokenizer, t): finite(v) for t, v in entry.top}
        top.setdefault(text, values[-1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_entries(tokenizer: Tokenizer | None, entries: list[TokenLogprob]) -> list[dict]:
    """[{'token', 'logprob', 'bytes', 'top_logprobs': [...]}] as chat completions return them."""

    def item(token_id: int, value: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": finite(value), "bytes": list(text.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
            for e in entries]
