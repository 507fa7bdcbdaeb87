"""What the OpenAPI document (/openapi.json) says beyond the routes' response models
(responses.py): every status a route answers, the error schema, the media types, the stream
events; the request bodies, which the routes parse themselves (off the event loop), are added
to it here. tests/server/test_server_openapi.py fuzzes the server against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from zipage_jax.server.auth import requires_key
from zipage_jax.server.errors import REQUEST_ID_HEADER
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.responses import ChatCompletionChunk, CompletionChunk, ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Malformed JSON, a missing, mistyped, unknown or out-of-range field, text that is not valid Unicode, "
         "or a prompt too long for the context.",
    401: "The server has an API key (--api-key) and the request does not carry it as `Authorization: Bearer KEY` "
         "(code invalid_api_key).",
    404: "No model of that name is served (code model_not_found).",
    413: "The request body is over the server's --max-request-bytes.",
    415: "The request body is not declared JSON (Content-Type: application/json or a +json type).",
    500: "The server failed; the message gives the request id, which the server's log line carries.",
    503: "The model is still loading, failed to load, or is warming up (code warming_up: its compiled programs "
         "are being built); or (generation, with Retry-After) the server's queue is "
         "full (--max-queued-requests).",
}
_REQUEST_ID = {REQUEST_ID_HEADER: {"description": "This request's id, as the server logs it.", "required": True,
                                   "schema": {"type": "string"}}}
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying, when the queue is full.",
                          "schema": {"type": "string"}}},
}
_BEARER = "bearer"
_EVENT_STREAM = ("With \"stream\": true, server-sent events whose data are {chunk} objects, an "
                 "ErrorResponse if the request fails, and last `[DONE]`.")


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 has a text/event-stream schema describe each event)."""
    json_data = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model=ErrorResponse.__name__)}]}}
    data = {"type": "string", "pattern": r"^(\[DONE\]|\{.*\})$", "anyOf": [{"const": "[DONE]"}, json_data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def responses(ok: type[BaseModel] | None, *errors: int, stream: type[BaseModel] | None = None,
              ok_media: str | None = None, ok_description: str = "Success.") -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: 200 (`ok` as JSON, `ok_media` as text, and with `stream`, the
    events of that chunk model) and `errors`."""
    success: dict[str, Any] = {"description": ok_description, "headers": _REQUEST_ID}
    if ok is not None:
        success["model"] = ok
    if ok_media is not None:
        success["content"] = {ok_media: {"schema": {"type": "string"}}}
    if stream is not None:
        success["description"] += " " + _EVENT_STREAM.format(chunk=stream.__name__)
        success["content"] = {"text/event-stream": {"schema": _event(stream)}}
    documented = {200: success}
    error = {"application/json": {"schema": {"$ref": _REF.format(model=ErrorResponse.__name__)}}}
    for status in errors:
        documented[status] = {"content": error, "description": _ERRORS[status],
                              "headers": {**_REQUEST_ID, **_ERROR_HEADERS.get(status, {})}}
    return documented


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra=` of a route that parses `model` from its JSON body itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def path_parameter(name: str) -> dict[str, Any]:
    """The `openapi_extra=` of a route that reads the string path parameter `name` itself
    (so that FastAPI adds no 422 of its own)."""
    return {"parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]], model_names: list[str],
                    limits: RequestLimits, api_key: bool = False) -> None:
    """app.openapi() with the error, stream chunk and `request_models` schemas among the
    components, the latter's `model` field one of `model_names` (any other is a 404), the
    bounds of `limits`, and with `api_key` the bearer key (and its 401) on the routes that need it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            described = [*request_models, ErrorResponse, CompletionChunk, ChatCompletionChunk]
            _, defs = models_json_schema([(m, "validation") for m in described], ref_template=_REF)
            for model in request_models:
                field = defs["$defs"][model.__name__].get("properties", {}).get("model")
                if field is not None:
                    _served_names(field, model_names)
            limits.document(defs["$defs"])
            document.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            if api_key:
                _require_key(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi


def _require_key(document: dict[str, Any]) -> None:
    """The bearer scheme, and on each operation that needs the key, it and its 401."""
    document["components"]["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
    unauthorized = responses(None, 401)[401]
    for path, item in document["paths"].items():
        if requires_key(path):
            for operation in item.values():
                operation["security"] = [{_BEARER: []}]
                operation["responses"]["401"] = unauthorized


def _served_names(field: dict[str, Any], model_names: list[str]) -> None:
    """A `model` field's string (the member of an optional field's anyOf) is one of `model_names`."""
    string = next((member for member in field.get("anyOf", ()) if member.get("type") == "string"), field)
    string["enum"] = list(model_names)
