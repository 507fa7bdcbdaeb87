"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages rendered with the
template) and POST /detokenize. Tokenizing, and rendering /tokenize's answer, run in the
Preprocessor's threads."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.server.openapi import Detokenized, Tokenized, request_body, responses
from zipage_jax.server.preprocess import Preprocessor
from zipage_jax.server.protocol import DetokenizeRequest, TokenizeRequest
from zipage_jax.server.served import ServedModels

_ERRORS = (400, 404, 413, 415, 500, 503)


def add_tokenization_routes(app: FastAPI, served: ServedModels, preprocessor: Preprocessor,
                            ready_engine: Callable[[], LLMEngine]) -> None:
    """`ready_engine()`: the loaded engine, else OpenAIError 503."""

    @app.post("/tokenize", response_model=None, openapi_extra=request_body(TokenizeRequest),
              responses=responses(Tokenized, *_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        body = (await preprocessor.body(request, TokenizeRequest)).root
        if body.model is not None:
            served.check(body.model)
        max_model_len = ready_engine().max_model_len

        def tokenized() -> JSONResponse:  # rendered in the pool too: a response of a million ids takes a while
            ids, token_strs = preprocessor.tokenize(body)
            return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                                 "token_strs": token_strs})

        return await preprocessor.run(tokenized)

    @app.post("/detokenize", response_model=None, openapi_extra=request_body(DetokenizeRequest),
              responses=responses(Detokenized, *_ERRORS))
    async def detokenize(request: Request) -> JSONResponse:
        body = await preprocessor.body(request, DetokenizeRequest)
        if body.model is not None:
            served.check(body.model)
        ready_engine()
        return JSONResponse({"prompt": await preprocessor.run(preprocessor.detokenize, body.tokens)})
