"""Every error as OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("zipage_jax.server")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          500: "server_error", 503: "service_unavailable"}
# ValueError messages from SamplingParams / the engine start with the offending field's name
_ENGINE_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "max_tokens",
                  "logprobs", "kv_budget", "eviction_policy", "prompt", "skip_special_tokens", "include_stop_str_in_output")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def bad_request(cls, exc: ValueError, param_names: dict[str, str] | None = None) -> "OpenAIError":
        """A ValueError from SamplingParams or add_request; param_names renames engine fields."""
        message = str(exc)
        first = message.split(" ", 1)[0]
        param = first if first in _ENGINE_PARAMS else None
        if param is not None and param_names:
            param = param_names.get(param, param)
        return cls(400, message, param=param)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 list of pydantic errors -> one 400 naming the first bad field."""
    errors = exc.errors()
    first = errors[0]
    loc = _path(first)
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        return OpenAIError(400, f"request body: {first['msg']}")
    field = loc[0]
    if len(loc) > 1 and _is_union_tag(loc[1]):  # pydantic tried each member of a union: name them all
        tags = [p[1] for p in map(_path, errors) if len(p) > 1 and p[0] == field and _is_union_tag(p[1])]
        shapes = ", ".join(dict.fromkeys(tags))
        return OpenAIError(400, f"{field}: invalid value; expected one of: {shapes}", param=field)
    where = ".".join(loc)
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"{where}: unsupported parameter", param=field)
    return OpenAIError(400, f"{where}: {first['msg']}", param=field)


def _path(error: dict) -> list[str]:
    return [str(p) for p in error["loc"] if p != "body"]


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part


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

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)
