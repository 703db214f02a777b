"""Incremental detokenization: whole UTF-8 characters only, and stop strings across tokens."""

from frugal.engine.detokenizer import IncrementalDetokenizer, find_stop

TEXT = "Café 日本語 🙂👍🏽 — naïve Ελληνικά; emoji at the end 🎉"


def test_incremental_equals_full_decode_and_never_splits_a_character(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    # byte-level BPE splits some of these characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(deltas) == TEXT == detok.take(final=False)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.unsent == ""  # what was taken is not kept


def test_final_flush_keeps_a_trailing_partial_character(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    for n in range(1, cut + 1):
        detok.update(ids[:n])
    shown = detok.take(final=False)
    assert "\ufffd" not in shown
    detok.update(ids[:cut], final=True)
    assert shown + detok.take(final=True) == tok.decode(ids[:cut])


def test_special_tokens_skipped(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello") + [2]
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    assert detok.take(final=True) == "Hello"


def test_stop_strings_are_held_back_and_cut(llm):
    tok = llm.get_tokenizer()
    text = "one two three STOP four"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stops=["STOP", "xyz"])
    shown, stop = "", None
    for n in range(1, len(ids) + 1):
        delta = detok.update(ids[:n])
        stop = detok.find_stop(len(delta)) if delta else None
        if stop is not None:
            break
        shown += detok.take(final=False)
        assert not shown.endswith(("S", "ST", "STO"))  # no part of a stop string shown
        assert len(detok.unsent) <= 3
    assert stop == "STOP"
    assert shown + detok.take(final=True) == "one two three "


def test_find_stop():
    assert find_stop("abc STOP def", 5, ["STOP"]) == (4, "STOP")
    assert find_stop("abc STOP def", 3, ["STOP"]) is None  # ended before the new text
    assert find_stop("xxSTOPyyEND", 9, ["END", "STOP"]) == (2, "STOP")
    assert find_stop("ab", 2, ["abc"]) is None
