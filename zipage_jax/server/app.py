"""create_app: the OpenAI-compatible FastAPI app around an EngineLoop.

    app = create_app(lambda: LLMEngine(model="default"), ["default"])
    uvicorn.run(app, host="127.0.0.1", port=8000)

The model loads in the engine thread once the app starts; until then /health answers 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from zipage_jax.chat import chat_prompt_ids
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.server.engine_loop import EngineLoop, RequestFailed
from zipage_jax.server.errors import OpenAIError, install_error_handlers
from zipage_jax.server.formats import ChatFormat, CompletionFormat
from zipage_jax.server.generation import EventStream, Generation, until_disconnected
from zipage_jax.server.metrics import ServerMetrics
from zipage_jax.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED = 499


def create_app(engine_factory: Callable[[], LLMEngine], served_model_names: list[str],
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    if not served_model_names:
        raise ValueError("served_model_names is empty")
    names = list(served_model_names)
    metrics = ServerMetrics(names[0], lambda: engine_loop.stats)
    engine_loop = EngineLoop(engine_factory, observer=metrics, on_load_error=on_load_error)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop()

    app = FastAPI(title="zipage-jax", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    install_error_handlers(app)

    def ready_engine() -> LLMEngine:
        if not engine_loop.ready.is_set():
            raise OpenAIError(503, "the model is still loading" if engine_loop.load_error is None
                              else f"the model failed to load: {engine_loop.load_error}")
        return engine_loop.engine

    def check_model(name: str) -> None:
        if name not in names:
            raise OpenAIError(404, f"The model `{name}` does not exist. Served: {', '.join(names)}.",
                              param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ready_engine()
        except OpenAIError as exc:
            return exc.response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        engine = engine_loop.engine if engine_loop.ready.is_set() else None
        max_len = engine.config.max_model_len if engine is not None else None
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "zipage-jax", "max_model_len": max_len}
            for name in names]})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        engine = ready_engine()
        prompts = _completion_prompts(body.prompt, engine_loop.tokenizer)
        limit = engine.config.max_model_len
        max_tokens = min(_max_tokens(len(p), body.max_tokens, limit, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                         for p in prompts)
        params = _sampling_params(body, max_tokens, body.logprobs)
        return await _generate(request, body, Generation(engine_loop, prompts, params,
                                                          CompletionFormat(body.model, engine_loop.tokenizer)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        engine = ready_engine()
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = _chat_prompt(body, engine_loop.tokenizer)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        limit = engine.config.max_model_len
        max_tokens = _max_tokens(len(prompt), requested, limit, limit - len(prompt), "messages")
        params = _sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                  renames={"logprobs": "top_logprobs"})
        return await _generate(request, body, Generation(engine_loop, [prompt], params,
                                                          ChatFormat(body.model, engine_loop.tokenizer)))

    return app


async def _generate(request: Request, body: SamplingFields, generation: Generation) -> Response:
    try:
        await generation.start()
    except ValueError as exc:
        raise OpenAIError.bad_request(exc) from exc
    except Exception as exc:
        raise OpenAIError(500, f"adding the request failed: {type(exc).__name__}: {exc}") from exc
    if body.stream:
        return EventStream(generation.events(body.include_usage), on_close=generation.abort)
    try:
        result = await until_disconnected(request, asyncio.ensure_future(generation.response()))
    except RequestFailed as exc:
        raise OpenAIError(500, str(exc)) from exc
    finally:
        generation.abort()
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(result)


def _completion_prompts(prompt: str | list, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    prompts = [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompt]
    if not all(prompts):
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    return prompts


def _chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    if not body.messages:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    try:
        return chat_prompt_ids(tokenizer, [m.as_template_input() for m in body.messages])
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc


def _max_tokens(prompt_len: int, requested: int | None, limit: int, default: int, prompt_param: str) -> int:
    if prompt_len >= limit:
        raise OpenAIError(400, f"the prompt has {prompt_len} tokens but this model's maximum context length is "
                          f"{limit} tokens (at least one token must be generated)", param=prompt_param)
    if requested is None:
        return min(default, limit - prompt_len)
    if prompt_len + requested > limit:
        raise OpenAIError(400, f"this model's maximum context length is {limit} tokens, but {prompt_len + requested} "
                          f"were requested ({prompt_len} in the prompt, {requested} in the completion)",
                          param="max_tokens")
    return requested


def _sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                     renames: dict[str, str] | None = None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, renames) from exc
