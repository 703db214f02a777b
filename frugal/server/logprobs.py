"""Log-probabilities in the two OpenAI shapes: legacy completions and chat."""

from __future__ import annotations

from frugal.request import TokenLogprob
from frugal.tokenizer import Tokenizer


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
        values.append(entry.logprob)
        top = {token_text(tokenizer, t): v for t, v in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_entries(tokenizer: Tokenizer | None, entries: list[TokenLogprob]) -> list[dict]:
    """[{'token', 'logprob', 'bytes', 'top_logprobs': [...]}] as chat completions return them."""

    def item(token_id: int, value: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
            for e in entries]
