"""Every error as OpenAI's schema: {"error": {"message", "type", "param", "code"}}.

A 500 says only that the server failed, with the request id its log line carries: no
exception text leaves the server.
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from zipage_jax.sampling_params import SamplingParams
from zipage_jax.server.protocol import SHAPE_FIELDS
from zipage_jax.server.responses import ErrorDetail, ErrorResponse

logger = logging.getLogger("zipage_jax.server")

REQUEST_ID_HEADER = "X-Request-Id"
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}
# ValueError messages from SamplingParams / the engine start with the offending field's name
_ENGINE_PARAMS = (*(f.name for f in dataclasses.fields(SamplingParams)), "prompt")
_MAX_FIELD_CHARS = 100  # of a client's field name quoted in an error


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @classmethod
    def bad_request(cls, exc: ValueError, param_names: dict[str, str] | None = None) -> "OpenAIError":
        """A ValueError from SamplingParams or add_request; param_names renames engine fields."""
        message = str(exc)
        first = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
        param = first if first in _ENGINE_PARAMS else None
        if param is not None and param_names:
            param = param_names.get(param, param)
        return cls(400, message, param=param)

    @classmethod
    def internal(cls, request_id: str) -> "OpenAIError":
        return cls(500, internal_message(request_id))

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_message(request_id: str) -> str:
    return f"the server failed to process the request (request id {request_id})"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    detail = ErrorDetail(message=_printable(message), type=kind, param=None if param is None else _printable(param),
                         code=code)
    return ErrorResponse(error=detail).body()


def _printable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates quoted from a request) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """pydantic's list of errors -> one 400 naming the first bad field."""
    first = exc.errors()[0]
    loc = _path(first)
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if first["type"] == "string_unicode":  # a lone surrogate, in a value or (no location) a field name
        where = ".".join(loc) if loc else "request body: a field name"
        return OpenAIError(400, f"{where}: this text is not valid Unicode (a lone surrogate)",
                           param=loc[0] if loc else None)
    if not loc:
        return OpenAIError(400, f"request body: {first['msg']}")
    field, where = loc[0], ".".join(loc)
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"{where}: unsupported parameter", param=field)
    return OpenAIError(400, f"{where}: {first['msg'].removeprefix('Value error, ')}", param=field)


def _path(error: dict) -> list[str]:
    """The error's location; a shape name after a field of several shapes is dropped."""
    path: list[str] = []
    for part in error["loc"]:
        if part == "body" or (path and path[-1] in SHAPE_FIELDS and isinstance(part, str)):
            continue
        path.append(str(part)[:_MAX_FIELD_CHARS])
    return path


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)
