"""Response bodies: each is built as one of these models and sent as its `body()`, and the same
model documents it in /openapi.json (openapi.py).

A body holds exactly the fields given when it was built, in the order they are declared here:
a field without a default is always on the wire (null where its type allows), a field with a
default only when given (OpenAI's optional fields: usage details, a chat delta's role, vLLM's
prompt_logprobs), which is also what the document says.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ResponseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict[str, Any]:
        """The JSON object sent: the fields given, in declaration order."""
        return self.model_dump(exclude_unset=True)


class ErrorDetail(ResponseBody):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ResponseBody):
    error: ErrorDetail


class Health(ResponseBody):
    status: Literal["ok"]


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None  # None while the model loads


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


class Version(ResponseBody):
    version: str


class Tokenized(ResponseBody):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(ResponseBody):
    prompt: str


class PromptTokensDetails(ResponseBody):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(ResponseBody):
    reasoning_tokens: int  # generated tokens of the reasoning, its tags included (with a reasoning parser)


class KVCacheUsage(ResponseBody):
    """The KV memory of the request's largest sequence (zipage extension)."""

    kv_blocks_peak: int  # the most KV blocks it held at once
    kv_budget_tokens: int  # its budget when it finished, in tokens (0: full KV; an automatic one's last size)


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser
    prompt_tokens_details: PromptTokensDetails | None = None  # absent from continuous_usage_stats chunks
    kv_cache: KVCacheUsage | None = None  # once every sequence finished

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
           reasoning_tokens: int | None = None, kv_cache: KVCacheUsage | None = None) -> Usage:
        """OpenAI's usage; `cached_tokens`: prompt tokens found in the prefix cache, `reasoning_tokens`:
        completion tokens of the reasoning, `kv_cache`: its KV memory (each None: no such details)."""
        details = {} if kv_cache is None else {"kv_cache": kv_cache}
        if reasoning_tokens is not None:
            details["completion_tokens_details"] = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        if cached_tokens is not None:
            details["prompt_tokens_details"] = PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, **details)


FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]
StopReason = str | int | None  # the stop string or stop token id that ended the choice


class PromptLogprob(ResponseBody):
    """vLLM's entry for a prompt token or one of its top alternatives."""

    logprob: float
    rank: int | None  # among the alternatives, 1 the likeliest; None: the prompt token, below them
    decoded_token: str


# per prompt token, None for the first (nothing predicts it), else by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(ResponseBody):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM)


class Completion(ResponseBody):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(ResponseBody):
    token: str
    logprob: float
    bytes: list[int]


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseBody):
    content: list[ChatCompletionTokenLogprob]


class MessageFunctionCall(ResponseBody):
    name: str
    arguments: str  # JSON text of an object; a parsed call's as the model wrote it (not JSON if it broke it)


class MessageToolCall(ResponseBody):
    id: str
    type: Literal["function"]
    function: MessageFunctionCall


class AssistantMessage(ResponseBody):
    role: Literal["assistant"]
    content: str | None  # None when the message is tool calls (or reasoning) alone
    reasoning_content: str | None = None  # with a reasoning parser (vLLM)
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(ResponseBody):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason
    stop_reason: StopReason


class ChatCompletion(ResponseBody):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM)


# Stream chunks: `usage` only with stream_options.include_usage (null but in the last chunk,
# which has no choices, unless continuous_usage_stats); a choice's finish_reason is null until
# its last chunk, and its first chunk carries prompt_logprobs when asked for.
class CompletionChunkChoice(ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason
    prompt_logprobs: PromptLogprobs | None = None


class CompletionChunk(ResponseBody):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class FunctionCallDelta(ResponseBody):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the JSON text of the arguments, or the next piece of it


class ToolCallDelta(ResponseBody):
    """A tool call in a stream, or a piece of one: its first delta has the id, the type and the
    function's name (a parsed call's has arguments "", its next deltas the arguments' next text);
    one made by tool_choice "required" or a named function comes whole, in its choice's last delta."""

    index: int  # of the call in its choice
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(ResponseBody):
    role: Literal["assistant"] | None = None  # in the opening chunk
    content: str | None = None  # None beside tool calls
    reasoning_content: str | None = None  # with a reasoning parser (vLLM)
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ResponseBody):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: StopReason = None  # absent from the opening chunk
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionChunk(ResponseBody):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
