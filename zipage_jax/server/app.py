"""create_app: the OpenAI-compatible FastAPI app around an EngineClient (server/engine_client.py):
its routes, each answered by the serving module of its family (serving_completion.py,
serving_chat.py, serving_tokenization.py, serving_models.py) over the parts they share
(serving.py).

    app = create_app(MultiProcessEngineClient(EngineConfig(model="default")), ["default"])
    uvicorn.run(app, host="127.0.0.1", port=8000)

The model loads (in the engine core's process) once the app starts; until then /health answers
503, as it does while the engine rebuilds its device state after a failed step, and once it has
failed.
With `warmup`, the engine then builds its compiled programs in the background, the serving set
first; /health, the generation and the tokenizer routes answer 503 until that set is ready.
Request bodies are parsed, chat templates rendered and prompts tokenized in a Preprocessor
thread, and outputs with log-probabilities formatted in the FormatThread, never on the event
loop. Generation requests are admitted while the queue has room (queue_capacity.py); with an API
key, the /v1 and tokenizer routes need it (auth.py). Besides OpenAI's routes it serves vLLM's
/tokenize, /detokenize and /version (docs/openai-compatibility.md lists what is supported).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from zipage_jax.sampling_params import MAX_N
from zipage_jax.server import serving_models, serving_tokenization
from zipage_jax.server.auth import ApiKey
from zipage_jax.server.chat_output import ChatParsing
from zipage_jax.server.engine_client import EngineClient
from zipage_jax.server.errors import install_error_handlers
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.middleware import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from zipage_jax.server.openapi import install_openapi, path_parameter, request_body, responses
from zipage_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from zipage_jax.server.queue_capacity import DEFAULT_MAX_QUEUED_REQUESTS
from zipage_jax.server.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Detokenized,
    Health,
    ModelCard,
    ModelList,
    Tokenized,
    Version,
)
from zipage_jax.server.served import ServedModels
from zipage_jax.server.serving import OpenAIServing
from zipage_jax.server.serving_chat import create_chat_completion
from zipage_jax.server.serving_completion import create_completion

_REQUEST_MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, TokenizeCompletionRequest,
                   TokenizeChatRequest, DetokenizeRequest]
_BODY_ERRORS = (400, 404, 413, 415, 500, 503)  # of a route that parses a body and needs the engine


def create_app(client: EngineClient, served_model_names: list[str],
               on_load_error: Callable[[BaseException], None] | None = None, *, max_n: int = MAX_N,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limits: RequestLimits | None = None,
               on_engine_error: Callable[[BaseException], None] | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, api_key: str | None = None,
               warmup: bool = False, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, stream_interval: int = 1) -> FastAPI:
    """`max_n` caps n (never above MAX_N, nor the engine's max_num_seqs); a body over
    `max_request_bytes` is answered 413 unread; `limits` bounds other counts (default:
    RequestLimits()); a generation request that would make more than `max_queued_requests`
    sequences wait is answered 503; with `api_key`, the /v1 and tokenizer routes need it;
    `on_engine_error(exc)` runs (on the client's output thread) once the engine can no longer
    serve; with `warmup`, the loaded engine builds its programs in the background
    (`EngineCore.start_warmup`) and the server is not ready until their serving set is, the
    warm-up stopping when the server does. `enable_auto_tool_choice`, `tool_call_parser`,
    `reasoning_parser`: how chat outputs are parsed, `stream_interval`: tokens per streamed chunk
    (ServerConfig's fields of those names say what each does). Raises ValueError for a bad value."""
    served = ServedModels(served_model_names)
    limits = limits or RequestLimits()
    chat_parsing = ChatParsing.from_options(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    serving = OpenAIServing(client, served, limits, max_n, max_queued_requests, on_load_error,
                            on_engine_error, warmup, chat_parsing, stream_interval)
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    key = None if api_key is None else ApiKey(api_key)

    app = FastAPI(title="zipage-jax", lifespan=serving.lifespan)
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes, api_key=key)
    app.state.engine_client = client
    app.state.preprocessor = serving.preprocessor
    app.state.queue = serving.queue
    app.state.serving = serving  # stop_admitting, abort_in_flight: the server's shutdown (shutdown.py)
    install_error_handlers(app)
    install_openapi(app, _REQUEST_MODELS, served.names, limits, key is not None)
    _add_routes(app, serving)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.get("/health", response_model=None, responses=responses(Health, 500, 503))
    async def health() -> JSONResponse:
        return serving_models.health(serving)

    @app.get("/v1/models", response_model=None, responses=responses(ModelList, 500))
    async def models() -> JSONResponse:
        return serving_models.list_models(serving)

    @app.get("/v1/models/{model_id:path}", response_model=None, openapi_extra=path_parameter("model_id"),
             responses=responses(ModelCard, 404, 500))
    async def model(request: Request) -> JSONResponse:
        return serving_models.retrieve_model(serving, request.path_params["model_id"])  # may hold "/" (org/name)

    @app.get("/version", response_model=None, responses=responses(Version, 500))
    async def package_version() -> JSONResponse:
        return serving_models.version()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=responses(None, 500, ok_media="text/plain", ok_description="Prometheus text format."))
    async def prometheus_metrics() -> Response:
        return serving_models.metrics(serving)

    @app.post("/v1/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
              responses=responses(Completion, *_BODY_ERRORS, stream=CompletionChunk))
    async def completions(request: Request) -> Response:
        return await create_completion(serving, request)

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
              responses=responses(ChatCompletion, *_BODY_ERRORS, stream=ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving, request)

    @app.post("/tokenize", response_model=None, openapi_extra=request_body(TokenizeRequest),
              responses=responses(Tokenized, *_BODY_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        return await serving_tokenization.tokenize(serving, request)

    @app.post("/detokenize", response_model=None, openapi_extra=request_body(DetokenizeRequest),
              responses=responses(Detokenized, *_BODY_ERRORS))
    async def detokenize(request: Request) -> JSONResponse:
        return await serving_tokenization.detokenize(serving, request)
