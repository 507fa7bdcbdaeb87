"""POST /v1/completions: one or more prompts (text or token ids), each completed n times."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.generation import Echo, Generation
from zipage_jax.server.limits import num_prompts
from zipage_jax.server.protocol import CompletionRequest
from zipage_jax.server.response_builders import CompletionBuilder
from zipage_jax.server.serving import OpenAIServing, engine_param_names, max_tokens, sampling_params
from zipage_jax.server.structured import grammar

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(serving: OpenAIServing, request: Request) -> Response:
    preprocessor = serving.preprocessor
    body = await preprocessor.body(request, CompletionRequest)
    limit = serving.checked_model_info(body).max_model_len
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "max_tokens may be 0 only with echo (the output is then the prompt alone)",
                          param="max_tokens")
    with serving.queue.reserve(num_prompts(body.prompt) * (body.n or 1)) as reservation:
        prompts = await preprocessor.run(preprocessor.completion_prompts, body.prompt, limit)
        requested = None if body.max_tokens is None else max(body.max_tokens, 1)  # 0: one token, dropped
        most = min(max_tokens(len(p), requested, limit, DEFAULT_MAX_TOKENS) for p in prompts)
        echoed = body.echo and body.logprobs is not None and body.prompt_logprobs is None
        structured = grammar(body.response_format, body.structured_outputs)
        renames = engine_param_names(structured)
        params = sampling_params(body, most, body.logprobs, renames, structured,
                                 prompt_logprobs=body.logprobs if echoed else body.prompt_logprobs)
        echo = None
        if body.echo:
            texts = await preprocessor.run(preprocessor.prompt_texts, body.prompt, prompts)
            echo = Echo(texts, prompt_only=body.max_tokens == 0)
        request_id = request.state.request_id
        builder = CompletionBuilder(body.model, serving.client.tokenizer, request_id)
        generation = Generation(serving.client, prompts, params, builder, request_id, reservation,
                                serving.format_thread, echo, stream=bool(body.stream),
                                stream_interval=serving.stream_interval)
        return await serving.respond(request, body, generation, renames)
