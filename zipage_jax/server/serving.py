"""OpenAIServing: what the endpoint families (serving_*.py) share: the parts of the server, the
engine once it can serve, a generation request's admission, and the steps from a started
Generation to its response."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from zipage_jax.engine.admission import check_prompt_length
from zipage_jax.engine.core import ModelInfo
from zipage_jax.sampling_params import MAX_N, SamplingParams
from zipage_jax.server.chat_output import ChatParsing
from zipage_jax.server.engine_client import EngineClient, RequestFailed
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.format_thread import FormatThread
from zipage_jax.server.generation import EventStream, Generation, failure_error, until_disconnected
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.metrics import ServerMetrics
from zipage_jax.server.preprocess import Preprocessor
from zipage_jax.server.protocol import SamplingFields
from zipage_jax.server.queue_capacity import QueueCapacity
from zipage_jax.server.served import ServedModels
from zipage_jax.server.shutdown import SHUTTING_DOWN, ServerShuttingDown
from zipage_jax.server.structured import Grammar

CLIENT_CLOSED = 499


class OpenAIServing:
    def __init__(self, client: EngineClient, served: ServedModels, limits: RequestLimits,
                 max_n: int, max_queued_requests: int, on_load_error: Callable[[BaseException], None] | None,
                 on_engine_error: Callable[[BaseException], None] | None, warmup: bool,
                 chat_parsing: ChatParsing | None = None, stream_interval: int = 1):
        """Raises ValueError for a bad value (see create_app)."""
        if not 1 <= max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {max_n}")
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.served, self.limits, self.max_n = served, limits, max_n
        self.chat_parsing = chat_parsing or ChatParsing()
        self.metrics = ServerMetrics(served.names[0], lambda: self.client.stats, lambda: self.client.warmup_status)
        self.queue = QueueCapacity(max_queued_requests, on_refused=lambda: self.metrics.refused("queue_full"))
        self.preprocessor = Preprocessor(limits)
        self.format_thread = FormatThread()
        self.client = client
        self._on_load_error, self._on_engine_error, self._warmup = on_load_error, on_engine_error, warmup
        self.draining = False  # the server is shutting down (stop_admitting)
        self._engine_stop_timeout = 30.0

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        """The engine runs while the app does; the worker threads stop with it."""
        self.client.start(asyncio.get_running_loop(), observer=self.metrics, on_loaded=self.preprocessor.prepare,
                          on_load_error=self._on_load_error, on_engine_error=self._on_engine_error,
                          warmup=self._warmup)
        yield
        self.client.stop(self._engine_stop_timeout)
        self.preprocessor.shutdown()
        self.format_thread.shutdown()

    def stop_admitting(self, engine_stop_timeout: float | None = None) -> None:
        """The server is shutting down: /health and the routes that need the engine answer 503 from
        now on; `engine_stop_timeout`: the engine's time to stop with the app, its step in progress
        included, if not the usual (flags: safe in a signal handler)."""
        self.draining = True
        if engine_stop_timeout is not None:
            self._engine_stop_timeout = engine_stop_timeout

    def abort_in_flight(self) -> None:
        """Ends every request in flight with ServerShuttingDown (a 503, or an error event)."""
        self.client.fail_requests(ServerShuttingDown())

    def ready_engine(self) -> ModelInfo:
        """The engine's model, once it can serve; OpenAIError 503 while it loads, warms up or has
        failed, and once the server is shutting down."""
        if self.draining:
            raise OpenAIError(503, SHUTTING_DOWN)
        client = self.client
        if not client.ready.is_set():
            raise OpenAIError(503, "the model is still loading" if client.load_error is None
                              else "the model failed to load (the server's log says why)")
        if client.engine_error is not None:
            raise OpenAIError(503, "the engine failed and cannot serve (the server's log says why)")
        status = client.warmup_status
        if status is not None and not status.serving_ready:
            progress = f"{status.ready} of {status.total} programs ready" if status.total else "it is starting"
            raise OpenAIError(503, f"the server is warming up: {progress}; "
                                   "it serves once the largest program of each kind is", code="warming_up")
        return client.model_info

    def max_model_len(self) -> int | None:
        """The engine's, None while the model loads."""
        return self.client.model_info.max_model_len if self.client.ready.is_set() else None

    def checked_model_info(self, body: SamplingFields) -> ModelInfo:
        """The engine's model info, once the request's model, n and counts are known to be served
        (OpenAIError otherwise)."""
        self.served.check(body.model)
        if body.n is not None and body.n > self.max_n:
            raise OpenAIError(400, f"n must be <= {self.max_n} (this server's --max-n), got {body.n}", param="n")
        self.limits.check(body)
        return self.ready_engine()

    async def respond(self, request: Request, body: SamplingFields, generation: Generation,
                      renames: dict[str, str] | None = None) -> Response:
        """Starts `generation` and answers with its events (stream) or its whole response; a
        client that disconnects first gets CLIENT_CLOSED."""
        try:
            await generation.start()
        except ValueError as exc:
            raise OpenAIError.bad_request(exc, renames) from exc
        except Exception:  # noqa: BLE001 - the engine's driver has logged it under the request id
            raise OpenAIError.internal(generation.request_id) from None
        if body.stream:
            return EventStream(generation.events(body.include_usage, body.continuous_usage),
                               on_close=generation.abort)
        try:
            result = await until_disconnected(request, asyncio.ensure_future(generation.response()))
        except RequestFailed as exc:  # logged by the engine client
            raise failure_error(exc, generation.request_id) from None
        finally:
            generation.abort()
        return Response(status_code=CLIENT_CLOSED) if result is None else result


def max_tokens(prompt_len: int, requested: int | None, limit: int, default: int,
               renames: dict[str, str] | None = None) -> int:
    """The completion's max_tokens: `requested`, else `default`, within the context `limit` left
    after the prompt; OpenAIError 400 if the prompt leaves no room or `requested` does not fit."""
    try:
        room = check_prompt_length(prompt_len, limit)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, renames) from exc
    if requested is None:
        return min(default, room)
    if requested > room:
        raise OpenAIError(400, f"this model's maximum context length is {limit} tokens, but {prompt_len + requested} "
                          f"were requested ({prompt_len} in the prompt, {requested} in the completion)",
                          param="max_tokens")
    return requested


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                    renames: dict[str, str] | None = None, structured_outputs: Grammar | None = None,
                    **overrides) -> SamplingParams:
    """The engine's parameters of the request; OpenAIError 400 naming the request's parameter."""
    if structured_outputs is not None:
        overrides["structured_outputs"] = structured_outputs.params
    try:
        return body.sampling_params(max_tokens, logprobs, **overrides)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, renames) from exc


def engine_param_names(structured: Grammar | None, renames: dict[str, str] | None = None) -> dict[str, str]:
    """Engine field -> request parameter, for the engine's errors."""
    return {**(renames or {}), **({} if structured is None else {"structured_outputs": structured.param})}
