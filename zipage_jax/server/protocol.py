"""Request bodies of the OpenAI API (plus vLLM's sampling extensions), validated strictly.

Unknown fields are rejected rather than ignored, so a misspelt or unsupported option is an
error the client sees, not a silent default. Every number carries the bound SamplingParams
enforces (so that the OpenAPI document states it), and every string must be Unicode text.
Counts that are the server's policy rather than the engine's (prompts per request, stop
strings, chat messages) are marked with the flag that bounds them: the handler enforces the
flag (limits.py), which also writes the bound into the OpenAPI document.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from zipage_jax.chat import RESERVED_TEMPLATE_KWARGS, check_chat_template_kwargs, tool_call_arguments
from zipage_jax.sampling_params import (
    BOUNDS,
    EVICTION_POLICIES,
    INT32_MAX,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    check_text,
)

LIMIT_FLAG = "x-limit-flag"  # OpenAPI extension: the server flag that bounds this array or string
PROMPTS_FLAG = "--max-prompts-per-request"
STOP_STRINGS_FLAG = "--max-stop-strings"
STOP_CHARS_FLAG = "--max-stop-chars"
MESSAGES_FLAG = "--max-chat-messages"
MESSAGES_BOUND = "max_chat_messages"  # the validation context's key for the server's bound on messages


def _valid_text(text: str) -> str:
    check_text("this text", text)
    return text


def _bounded_by(flag: str) -> dict[str, Any]:
    return {LIMIT_FLAG: flag}


def _text(**constraints: Any) -> Any:
    """A string with `constraints` that is Unicode text: a lone surrogate ("\ud800") is refused."""
    return Annotated[str, Field(**constraints), AfterValidator(_valid_text)]


Text = _text()
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # and, checked by the engine, below the vocabulary size
Real = Annotated[float, Field(allow_inf_nan=False)]


def _bounded(param: str, **field: Any) -> Any:
    """The number type of SamplingParams' `param`, with its range (sampling_params.BOUNDS)."""
    bound = BOUNDS[param]
    return Annotated[Real if bound.real else int, Field(**bound.pydantic_constraints(), **field)]


NonEmptyText = _text(min_length=1)

# A field that takes one of several shapes is validated as the shape its value has (no trial
# and error over a list of a million ids); an error's location names the shape after the field.
SHAPE_FIELDS = ("prompt", "stop", "content")


def _prompt_shape(value: object) -> str | None:
    if isinstance(value, str):
        return "string"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "strings" if isinstance(first, str) else "token id lists" if isinstance(first, list) else "token ids"


def _text_or_list(list_shape: str):
    return lambda value: "string" if isinstance(value, str) else list_shape if isinstance(value, list) else None


def _one_of(expected: str, shape, **members: Any) -> Any:
    """A union of `members` (shape name with _ for space -> type), validated by `shape(value)`."""
    tagged = tuple(Annotated[t, Tag(name.replace("_", " "))] for name, t in members.items())
    return Annotated[Union[tagged], Discriminator(shape, custom_error_type="shape",
                                                  custom_error_message=f"expected {expected}")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="with include_usage, every chunk carries its "
                                                            "choice's usage so far (vLLM extension)")


StopString = _text(min_length=1, json_schema_extra=_bounded_by(STOP_CHARS_FLAG))
Stop = _one_of("a string or a list of strings", _text_or_list("strings"), string=StopString,
               strings=Annotated[list[StopString], Field(json_schema_extra=_bounded_by(STOP_STRINGS_FLAG))])


JsonObject = dict[str, Any]


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    json_: JsonObject | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = Field(None, description='with tool_choice "auto": the calls of this function are '
                                                  "constrained to its parameters")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class SamplingFields(_Strict):
    """Fields shared by both endpoints; None means the SamplingParams default."""

    model: Text
    n: _bounded("n", description="completions per prompt; at most the server's --max-n and "
                                 "--max-num-seqs") | None = None
    max_tokens: _bounded("max_tokens") | None = None
    temperature: _bounded("temperature") | None = None
    top_p: _bounded("top_p") | None = None
    top_k: _bounded("top_k", description="0 or -1: off; at or above the vocabulary size: every token") | None = None
    min_p: _bounded("min_p") | None = None
    repetition_penalty: _bounded("repetition_penalty") | None = None
    presence_penalty: _bounded("presence_penalty") | None = None
    frequency_penalty: _bounded("frequency_penalty") | None = None
    seed: _bounded("seed") | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: _bounded("min_tokens") | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    kv_budget: _bounded("kv_budget") | Literal["auto"] | None = Field(
        None, description="KV tokens kept per sequence; 0 = full KV; \"auto\" = sized at each compaction by the "
                          "attention it would evict (zipage extension)")
    kv_budget_max: _bounded("kv_budget_max") | None = Field(
        None, description="kv_budget \"auto\": the most KV tokens kept per sequence; default: the server's "
                          "(zipage extension)")
    eviction_policy: Literal[EVICTION_POLICIES] | None = Field(
        None, description="which tokens a full sequence keeps; default: the server's (zipage extension)")
    keep_prompt: bool | None = Field(
        None, description="keep the prompt whole, outside kv_budget: memory is the prompt plus kv_budget "
                          "(zipage extension)")
    prompt_compression: Literal["bounded", "deferred"] | None = Field(
        None, description="a prompt longer than kv_budget: bounded compacts between prefill chunks (memory: the "
                          "budget and one chunk), deferred once at the prompt's end (memory: the whole prompt); "
                          "default: the server's (zipage extension)")
    prompt_logprobs: _bounded("prompt_logprobs") | None = Field(
        None, description="log-probabilities of the prompt tokens, with this many top alternatives (vLLM extension)")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="a grammar the output follows: exactly one of json, regex, choice, grammar, json_object "
                          "(vLLM extension)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int, logprobs: int | None, **overrides: Any) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for out-of-range values."""
        given = {name: getattr(self, name) for name in sampling_fields(type(self)) if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **{**given, **overrides})


# SamplingParams fields a request also has that the handler sets rather than copies: max_tokens (the
# room the prompt leaves), logprobs (a bool in chat) and structured_outputs (the compiled grammar).
SET_BY_HANDLER = frozenset({"max_tokens", "logprobs", "structured_outputs"})


@functools.cache
def sampling_fields(request: type[SamplingFields]) -> tuple[str, ...]:
    """The fields of `request` copied into SamplingParams as they are: every one SamplingParams
    also has, but SET_BY_HANDLER."""
    params = {f.name for f in fields(SamplingParams)}
    return tuple(name for name in request.model_fields if name in params and name not in SET_BY_HANDLER)


Prompt = _one_of("a string, a list of strings, a list of token ids or a list of token-id lists", _prompt_shape,
                string=NonEmptyText,
                strings=Annotated[list[NonEmptyText], Field(min_length=1, fail_fast=True,
                                                            json_schema_extra=_bounded_by(PROMPTS_FLAG))],
                token_ids=Annotated[list[TokenId], Field(min_length=1, fail_fast=True)],
                token_id_lists=Annotated[list[Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]],
                                         Field(min_length=1, fail_fast=True,
                                               json_schema_extra=_bounded_by(PROMPTS_FLAG))])


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: _bounded("logprobs") | None = None
    echo: bool = Field(False, description="the prompt comes first in each choice's text (and logprobs)")
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX, description="0: only the prompt (with echo)")] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


def _object_arguments(text: str) -> str:
    tool_call_arguments(text)
    return text


class FunctionCall(_Strict):
    name: Text
    arguments: Annotated[Text, AfterValidator(_object_arguments)] = Field(
        description="JSON text of an object (\"\" for none); the chat template gets the object")


class ToolCall(_Strict):
    id: Text
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _one_of("a string or a list of text parts", _text_or_list("parts"), string=Text,
                     parts=list[TextPart]) | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def text_bytes(self) -> int:
        """UTF-8 bytes of every string the chat template renders from this message, but the role."""
        parts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content or ()]
        parts += [self.name or "", self.tool_call_id or ""]
        for call in self.tool_calls or ():
            parts += [call.id, call.function.name, call.function.arguments]
        return sum(len(part.encode("utf-8")) for part in parts)

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        message = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_call_id"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


def _within_server_bound(messages: Any, info: ValidationInfo) -> Any:
    """The server's bound on messages (the validation context's MESSAGES_BOUND), checked before
    the messages are validated one by one, which for many thousands takes long."""
    bound = (info.context or {}).get(MESSAGES_BOUND)
    if bound is not None and isinstance(messages, list) and len(messages) > bound:
        raise ValueError(f"{len(messages)} messages, more than this server's {MESSAGES_FLAG} of {bound}")
    return messages


Messages = Annotated[list[ChatMessage],
                     Field(min_length=1, fail_fast=True, json_schema_extra=_bounded_by(MESSAGES_FLAG)),
                     BeforeValidator(_within_server_bound)]


def _template_kwargs(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, such as {{\"enable_thinking\": false}}, got {value!r:.50}")
    return check_chat_template_kwargs(value)


class ChatTemplateFields(_Strict):
    """How the messages are rendered with the model's chat template (vLLM's fields)."""

    add_generation_prompt: bool = Field(True, description="end the prompt with the start of an assistant turn")
    continue_final_message: bool = Field(
        False, description="end the prompt with the last message left open, for the model to continue it; needs "
                           "add_generation_prompt false (vLLM extension)")
    chat_template_kwargs: Annotated[JsonObject | None, BeforeValidator(_template_kwargs)] = Field(
        None, description="extra variables for the chat template, each key a variable's name, such as "
                          '{"enable_thinking": false} for Qwen3; a variable the template does not read has no '
                          "effect. Names the server sets (the template's inputs, special tokens and functions, and "
                          f"the renderer's options) are refused: {', '.join(RESERVED_TEMPLATE_KWARGS)} "
                          "(vLLM extension)")

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("needs add_generation_prompt false: the prompt ends either with the last message left "
                             "open or with a new assistant turn")
        return value


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: Messages
    logprobs: bool = False
    top_logprobs: _bounded("logprobs") | None = None
    max_completion_tokens: _bounded("max_tokens") | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools; needs the '
                                                             "server's --enable-auto-tool-choice and "
                                                             '--tool-call-parser), "required" or a named function')
    parallel_tool_calls: bool = True


# vLLM's /tokenize and /detokenize; `model`, if given, must be a served name.
class TokenizeCompletionRequest(_Strict):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    model: Text | None = None
    messages: Messages
    tools: list[Tool] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _tokenize_form(value: object) -> str | None:
    return None if not isinstance(value, dict) else "messages" if "messages" in value else "prompt"


class TokenizeRequest(RootModel):
    """The prompt form, or the chat form (a body with "messages"); a validation error's location
    starts with the form's tag."""

    root: Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("prompt")],
                          Annotated[TokenizeChatRequest, Tag("messages")]],
                    Discriminator(_tokenize_form, custom_error_type="shape",
                                  custom_error_message="expected an object with \"prompt\" or \"messages\"")]


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[TokenId]
