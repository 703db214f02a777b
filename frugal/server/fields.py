"""The field types of the request bodies, checked as pydantic parses them (on a pool thread: body).

Each costs O(what it checks) at most: a list past its limit is refused before its items are read,
a prompt is validated in the one form its first item says, token ids stop at the first bad one.
Checks that cost more run later, in the thread pool (protocol's check methods, jobs).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from frugal.tokenizer import lone_surrogate

MAX_PROMPTS = 1024  # prompts in one /v1/completions request


def _valid_unicode(text: str) -> str:
    at = lone_surrogate(text)
    if at is not None:
        raise PydanticCustomError(
            "invalid_unicode", "not valid Unicode (a lone surrogate at character {at})",
            {"at": at})
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every string a client sends


def at_most(limit: int) -> BeforeValidator:
    """Refuses a list longer than `limit` before its items are validated. Field(max_length=...)
    alone counts only after validating every item, on the event loop: seconds for a body of
    millions of items (it stays beside this one for the schema)."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise PydanticCustomError("too_long", "at most {limit} items, got {n}",
                                      {"limit": limit, "n": len(value)})
        return value

    return BeforeValidator(check)


def _prompt_form(value: Any) -> str | None:
    """Which form of prompt `value` is, from its first item, so that only that form is validated
    (a union tries every form: 7 s for a list of 8 M token ids)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    if not value or isinstance(value[0], str):
        return "list[str]"
    return "list[list[int]]" if isinstance(value[0], list) else "list[int]"


# Token ids: the first wrong item ends validation. Their length is checked against the model's
# max_model_len where that is known (jobs, the tokenizer routes), in the thread pool.
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Field(max_length=MAX_PROMPTS), at_most(MAX_PROMPTS), Tag("list[str]")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS), at_most(MAX_PROMPTS),
                Tag("list[list[int]]")],
    Discriminator(_prompt_form, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of strings, a list of token "
                                       "ids or a list of lists of token ids")]
