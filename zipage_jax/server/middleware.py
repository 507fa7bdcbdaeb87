"""RequestGuard: the app's outermost layer, in plain ASGI.

Each HTTP request gets an id (`request.state.request_id`, the X-Request-Id response header);
with an ApiKey, a request to a route that needs the key and does not carry it is answered 401
unread; a body over the size limit is answered 413 before anything parses it (by its Content-Length,
or, chunked, once the limit is passed); an exception that escapes the app becomes a 500 that
says only that the server failed, while the log line carries the traceback and the request id.
The connection stays open for the client's next request.
"""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zipage_jax.server.auth import ApiKey
from zipage_jax.server.errors import REQUEST_ID_HEADER, OpenAIError, error_body

logger = logging.getLogger("zipage_jax.server")

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class RequestGuard:
    def __init__(self, app: ASGIApp, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_key: ApiKey | None = None):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER.lower().encode(), request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        if self.api_key is not None:
            try:
                self.api_key.check(scope["path"], dict(scope["headers"]).get(b"authorization"))
            except OpenAIError as exc:
                await exc.response()(scope, receive, send_with_id)
                return
        try:
            body = await self._read_body(scope, receive)
        except _TooLarge:
            await self._too_large(scope, receive, send_with_id)
            return
        if body is None:  # the client went away while sending
            return
        try:
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception:
            logger.exception("request %s (%s %s) failed", request_id, scope["method"], scope["path"])
            if not started:
                await OpenAIError.internal(request_id).response()(scope, receive, send_with_id)
            else:  # mid-stream: end the body so the client is not left waiting
                await _end_body(send_with_id)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body (None if the client disconnected); raises _TooLarge once over the limit."""
        limit = self.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _TooLarge  # unread: the declared length decides
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _TooLarge
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of {self.max_request_bytes} bytes "
                   "(--max-request-bytes)")
        await JSONResponse(error_body(413, message), status_code=413)(scope, receive, send)


class _TooLarge(Exception):
    pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then the client's messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _end_body(send: Send) -> None:
    try:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:  # noqa: BLE001 - the connection is gone
        pass
