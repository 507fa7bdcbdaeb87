"""create_app: the OpenAI-compatible FastAPI app around an EngineLoop.

    app = create_app(lambda: LLMEngine(model="default"), ["default"])
    uvicorn.run(app, host="127.0.0.1", port=8000)

The model loads in the engine thread once the app starts; until then /health answers 503, as it
does while the engine rebuilds its device state after a failed step, and once it has failed.
With `warmup`, the engine then builds its compiled programs in the background, the serving set
first; /health, the generation and the tokenizer routes answer 503 until that set is ready.
Request bodies are parsed, chat templates rendered and prompts tokenized in a Preprocessor
thread, and outputs with log-probabilities formatted in the FormatThread, never on the event
loop. Generation requests are admitted while the queue has room (admission.py); with an API
key, the /v1 and tokenizer routes need it (auth.py). Besides OpenAI's routes it serves vLLM's
/tokenize, /detokenize and /version (docs/openai-compatibility.md lists what is supported).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.sampling_params import MAX_N, SamplingParams
from zipage_jax.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from zipage_jax.server.auth import ApiKey
from zipage_jax.server.engine_loop import EngineLoop, RequestFailed
from zipage_jax.server.errors import OpenAIError, install_error_handlers
from zipage_jax.server.format_thread import FormatThread
from zipage_jax.server.formats import ChatFormat, CompletionFormat
from zipage_jax.server.generation import Echo, EventStream, Generation, until_disconnected
from zipage_jax.server.limits import RequestLimits, num_prompts
from zipage_jax.server.metrics import ServerMetrics
from zipage_jax.server.middleware import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from zipage_jax.server.openapi import (
    ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Health, ModelCard, ModelList, Version,
    install_openapi, path_parameter, request_body, responses)
from zipage_jax.server.preprocess import Preprocessor
from zipage_jax.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields, TokenizeChatRequest,
    TokenizeCompletionRequest, TokenizeRequest)
from zipage_jax.server.served import ServedModels
from zipage_jax.server.structured import Grammar, grammar, tool_mode
from zipage_jax.server.tokenization import add_tokenization_routes

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED = 499
_GENERATION_ERRORS = (400, 404, 413, 415, 500, 503)


def create_app(engine_factory: Callable[[], LLMEngine], served_model_names: list[str],
               on_load_error: Callable[[BaseException], None] | None = None, *, max_n: int = MAX_N,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: RequestLimits | None = None,
               on_engine_error: Callable[[BaseException], None] | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, api_key: str | None = None,
               warmup: bool = False) -> FastAPI:
    """`max_n` caps n (never above MAX_N, nor the engine's max_num_seqs); a body over
    `max_request_bytes` is answered 413 unread; `limits` bounds other counts (default:
    RequestLimits()); a generation request that would make more than `max_queued_requests`
    sequences wait is answered 503; with `api_key`, the /v1 and tokenizer routes need it;
    `on_engine_error(exc)` runs (in the engine thread) once the engine can no longer serve;
    with `warmup`, the loaded engine builds its programs in the background
    (`LLMEngine.start_warmup`) and the server is not ready until their serving set is, the
    warm-up stopping when the server does. Raises ValueError for a bad value."""
    served = ServedModels(served_model_names)
    limits = limits or RequestLimits()
    if not 1 <= max_n <= MAX_N:
        raise ValueError(f"max_n must be in [1, {MAX_N}], got {max_n}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    key = None if api_key is None else ApiKey(api_key)
    metrics = ServerMetrics(served.names[0], lambda: engine_loop.stats, lambda: engine_loop.warmup_status)
    admission = Admission(max_queued_requests, on_refused=lambda: metrics.refused("queue_full"))
    preprocessor = Preprocessor(limits)
    format_thread = FormatThread()
    engine_loop = EngineLoop(engine_factory, observer=metrics, on_load_error=on_load_error,
                             on_loaded=preprocessor.prepare, on_engine_error=on_engine_error, warmup=warmup)
    version = _package_version()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop()
        preprocessor.shutdown()
        format_thread.shutdown()

    app = FastAPI(title="zipage-jax", lifespan=lifespan)
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes, api_key=key)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.preprocessor = preprocessor
    app.state.admission = admission
    install_error_handlers(app)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, TokenizeCompletionRequest,
                          TokenizeChatRequest, DetokenizeRequest], served.names, limits, key is not None)

    def ready_engine() -> LLMEngine:
        if not engine_loop.ready.is_set():
            raise OpenAIError(503, "the model is still loading" if engine_loop.load_error is None
                              else "the model failed to load (the server's log says why)")
        if engine_loop.engine.failed is not None:
            raise OpenAIError(503, "the engine failed and cannot serve (the server's log says why)")
        status = engine_loop.warmup_status
        if status is not None and not status.serving_ready:
            raise OpenAIError(503, f"the server is warming up: {status.ready} of {status.total} programs ready; "
                                   "it serves once the largest program of each kind is", code="warming_up")
        return engine_loop.engine

    def admit(body: SamplingFields) -> LLMEngine:
        """The engine, once the request's model, n and counts are known to be served."""
        served.check(body.model)
        if body.n is not None and body.n > max_n:
            raise OpenAIError(400, f"n must be <= {max_n} (this server's --max-n), got {body.n}", param="n")
        limits.check(body)
        return ready_engine()

    def max_model_len() -> int | None:
        return engine_loop.engine.max_model_len if engine_loop.ready.is_set() else None

    @app.get("/health", response_model=None, responses=responses(Health, 500, 503))
    async def health() -> JSONResponse:
        try:
            if not ready_engine().healthy:  # a failed engine is refused above
                raise OpenAIError(503, "the engine is rebuilding its device state after a failed step")
        except OpenAIError as exc:
            return exc.response()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", response_model=None, responses=responses(ModelList, 500))
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [served.card(name, max_model_len()) for name in served.names]})

    @app.get("/v1/models/{model_id:path}", response_model=None, openapi_extra=path_parameter("model_id"),
             responses=responses(ModelCard, 404, 500))
    async def model(request: Request) -> JSONResponse:
        model_id = request.path_params["model_id"]  # may hold "/" (org/name)
        served.check(model_id)
        return JSONResponse(served.card(model_id, max_model_len()))

    @app.get("/version", response_model=None, responses=responses(Version, 500))
    async def package_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=responses(None, 500, ok_media="text/plain", ok_description="Prometheus text format."))
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
              responses=responses(Completion, *_GENERATION_ERRORS, stream=CompletionChunk))
    async def completions(request: Request) -> Response:
        body = await preprocessor.body(request, CompletionRequest)
        limit = admit(body).max_model_len
        if body.max_tokens == 0 and not body.echo:
            raise OpenAIError(400, "max_tokens may be 0 only with echo (the output is then the prompt alone)",
                              param="max_tokens")
        with admission.reserve(num_prompts(body.prompt) * (body.n or 1)) as reservation:
            prompts = await preprocessor.run(preprocessor.completion_prompts, body.prompt, limit)
            requested = None if body.max_tokens is None else max(body.max_tokens, 1)  # 0: one token, dropped
            max_tokens = min(_max_tokens(len(p), requested, limit, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                             for p in prompts)
            echoed = body.echo and body.logprobs is not None and body.prompt_logprobs is None
            structured = grammar(body.response_format, body.structured_outputs)
            params = _sampling_params(body, max_tokens, body.logprobs, _renames(structured), structured,
                                      prompt_logprobs=body.logprobs if echoed else body.prompt_logprobs)
            echo = None
            if body.echo:
                texts = await preprocessor.run(preprocessor.prompt_texts, body.prompt, prompts)
                echo = Echo(texts, prompt_only=body.max_tokens == 0)
            request_id = request.state.request_id
            fmt = CompletionFormat(body.model, engine_loop.tokenizer, request_id)
            generation = Generation(engine_loop, prompts, params, fmt, request_id, reservation, format_thread, echo)
            return await _generate(request, body, generation, _renames(structured))

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
              responses=responses(ChatCompletion, *_GENERATION_ERRORS, stream=ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        body = await preprocessor.body(request, ChatCompletionRequest)
        limit = admit(body).max_model_len
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        with admission.reserve(body.n or 1) as reservation:
            prompt = await preprocessor.run(preprocessor.chat_prompt, body, limit)
            requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            max_tokens = _max_tokens(len(prompt), requested, limit, limit - len(prompt), "messages")
            structured = grammar(body.response_format, body.structured_outputs, body.tools, body.tool_choice,
                                 body.parallel_tool_calls)
            renames = _renames(structured, {"logprobs": "top_logprobs"})
            params = _sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      renames, structured)
            request_id = request.state.request_id
            fmt = ChatFormat(body.model, engine_loop.tokenizer, request_id, tool_mode(body.tools, body.tool_choice))
            generation = Generation(engine_loop, [prompt], params, fmt, request_id, reservation, format_thread)
            return await _generate(request, body, generation, renames)

    add_tokenization_routes(app, served, preprocessor, ready_engine)
    return app


async def _generate(request: Request, body: SamplingFields, generation: Generation,
                    renames: dict[str, str] | None = None) -> Response:
    try:
        await generation.start()
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, renames) from exc
    except Exception:  # the engine loop has logged it under the request id
        raise OpenAIError.internal(generation.request_id) from None
    if body.stream:
        return EventStream(generation.events(body.include_usage, body.continuous_usage), on_close=generation.abort)
    try:
        result = await until_disconnected(request, asyncio.ensure_future(generation.response()))
    except RequestFailed:  # logged by the engine loop
        raise OpenAIError.internal(generation.request_id) from None
    finally:
        generation.abort()
    return Response(status_code=CLIENT_CLOSED) if result is None else result


def _package_version() -> str:
    try:
        return importlib.metadata.version("zipage-jax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


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
                     renames: dict[str, str] | None = None, structured_outputs: Grammar | None = None,
                     **overrides) -> SamplingParams:
    if structured_outputs is not None:
        overrides["structured_outputs"] = structured_outputs.params
    try:
        return body.sampling_params(max_tokens, logprobs, **overrides)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, renames) from exc


def _renames(structured: Grammar | None, renames: dict[str, str] | None = None) -> dict[str, str]:
    """Engine field -> request parameter, for the engine's errors."""
    return {**(renames or {}), **({} if structured is None else {"structured_outputs": structured.param})}
