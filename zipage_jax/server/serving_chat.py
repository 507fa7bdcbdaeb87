"""POST /v1/chat/completions: the messages rendered with the model's chat template, completed n
times; the completions are split into reasoning, content and tool calls (chat_output.py)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.generation import Generation
from zipage_jax.server.protocol import ChatCompletionRequest
from zipage_jax.server.response_builders import ChatBuilder
from zipage_jax.server.serving import OpenAIServing, engine_param_names, max_tokens, sampling_params
from zipage_jax.server.structured import grammar

_PROMPT_PARAM = {"prompt": "messages"}  # the engine's name of what the request calls messages


async def create_chat_completion(serving: OpenAIServing, request: Request) -> Response:
    preprocessor = serving.preprocessor
    body = await preprocessor.body(request, ChatCompletionRequest)
    limit = serving.checked_model_info(body).max_model_len
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    with serving.queue.reserve(body.n or 1) as reservation:
        prompt = await preprocessor.run(preprocessor.chat_prompt, body, limit)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        most = max_tokens(len(prompt), requested, limit, limit - len(prompt), _PROMPT_PARAM)
        tokenizer = serving.client.tokenizer
        output = serving.chat_parsing.for_request(body.tools, body.tool_choice, prompt, tokenizer)
        structured = grammar(body.response_format, body.structured_outputs, body.tools, output.tool_choice,
                             body.parallel_tool_calls, output.tool_parser, output.reasoning)
        renames = engine_param_names(structured, {**_PROMPT_PARAM, "logprobs": "top_logprobs"})
        # a tool parser reads markers that may be special tokens (as vLLM's: whatever the request says), as
        # does a reasoning parser whose markers are special tokens (harmony's)
        reads_special = output.tool_parser is not None or (output.reasoning is not None
                                                           and output.reasoning.needs_special_tokens)
        keep_special = {"skip_special_tokens": False} if reads_special else {}
        params = sampling_params(body, most, (body.top_logprobs or 0) if body.logprobs else None, renames,
                                 structured, **keep_special)
        request_id = request.state.request_id
        builder = ChatBuilder(body.model, tokenizer, request_id, output)
        generation = Generation(serving.client, [prompt], params, builder, request_id, reservation,
                                serving.format_thread, stream=bool(body.stream),
                                stream_interval=serving.stream_interval)
        return await serving.respond(request, body, generation, renames)
