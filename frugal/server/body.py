"""Request bodies parsed and validated in the thread pool, so that a 16 MiB body does not hold the
event loop (FastAPI does both on the loop: ~0.6 s for 8 M token ids on an idle core, 2 s and more
on a busy one, during which /health and every other client wait).

A route that takes its body this way declares it with `documented(Model)` and reads it with
`await parsed(http, Model)`; the app's schema gets the models through `add_schemas`. Errors are
FastAPI's own RequestValidationError (locations under "body"), so the app answers them as it
answers every invalid body.
"""

from __future__ import annotations

import email.message
import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from frugal.server.protocol import APIError

M = TypeVar("M", bound=BaseModel)
_REF = "#/components/schemas/{model}"


async def parsed(http: HTTPRequest, model: type[M]) -> M:
    """The request's JSON body as a validated `model`, parsed and validated on a pool thread."""
    try:
        body = await http.body()
    except ClientDisconnect:  # (no one reads the answer; FastAPI's was a 400 too)
        raise APIError("body: the client left before sending all of it") from None
    if body and not _is_json(http.headers.get("content-type")):
        raise _invalid("send it as JSON, with Content-Type: application/json",
                       "model_attributes_type")
    return await run_in_threadpool(parse, model, body)


def parse(model: type[M], body: bytes) -> M:
    """(a pool thread) `body` as a `model`, or a RequestValidationError.

    pydantic_core's parser takes half json.loads' time (8 M ids: 0.2 against 0.47 s). Neither
    lets go of the GIL while it parses, nor does validation, so the event loop can wait that
    long for each, but not for the two together and not while it is the loop's own work. Where
    pydantic_core refuses what json.loads takes (a lone surrogate escape such as "\\ud800",
    which the fields' own checks answer with their names; nesting past 200), json.loads parses
    it instead; nesting past Python's recursion limit is invalid JSON."""
    if not body:
        raise _invalid("Field required", "missing")
    try:
        data = from_json(body)
    except ValueError:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError;
            raise _invalid(f"JSON decode error: {e}", "json_invalid") from None  # ~1,000 deep)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in e.errors(include_url=False)]
        ) from None


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """The route's `openapi_extra`: its JSON body is a `model` (whose schema add_schemas adds)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def add_schemas(schema: dict, models: list[type[BaseModel]]) -> None:
    """Adds `models` and the models they use to the schema's components, as FastAPI would."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: application/json or application/*+json; without a Content-Type, not."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def _invalid(message: str, kind: str) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": ("body",), "msg": message,
                                    "input": None}])
