"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages rendered with the
template) and POST /detokenize. Tokenizing, and rendering /tokenize's answer, run in the
Preprocessor's threads."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from zipage_jax.server.protocol import DetokenizeRequest, TokenizeRequest
from zipage_jax.server.responses import Detokenized, Tokenized
from zipage_jax.server.serving import OpenAIServing


async def tokenize(serving: OpenAIServing, request: Request) -> JSONResponse:
    preprocessor = serving.preprocessor
    body = (await preprocessor.body(request, TokenizeRequest)).root
    if body.model is not None:
        serving.served.check(body.model)
    max_model_len = serving.ready_engine().max_model_len

    def tokenized() -> JSONResponse:  # rendered in the pool too: a response of a million ids takes a while
        ids, token_strs = preprocessor.tokenize(body)
        return JSONResponse(Tokenized(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                      token_strs=token_strs).body())

    return await preprocessor.run(tokenized)


async def detokenize(serving: OpenAIServing, request: Request) -> JSONResponse:
    preprocessor = serving.preprocessor
    body = await preprocessor.body(request, DetokenizeRequest)
    if body.model is not None:
        serving.served.check(body.model)
    serving.ready_engine()
    return JSONResponse(Detokenized(prompt=await preprocessor.run(preprocessor.detokenize, body.tokens)).body())
