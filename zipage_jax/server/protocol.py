"""Request bodies of the OpenAI API (plus vLLM's sampling extensions), validated strictly.

Unknown fields are rejected rather than ignored, so a misspelt or unsupported option is an
error the client sees, not a silent default. Every number carries the bound SamplingParams
enforces (so that the OpenAPI document states it), and every string must be Unicode text.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from zipage_jax.sampling_params import (
    EVICTION_POLICIES, FLOAT32_MAX, INT32_MAX, MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
    SEED_MAX, SEED_MIN,
    SamplingParams, check_text)

MAX_PROMPTS = 256  # prompts in one /v1/completions request


def _valid_text(text: str) -> str:
    check_text("this text", text)
    return text


def _text(**constraints: int) -> Any:
    """A string with `constraints` that is Unicode text: a lone surrogate ("\ud800") is refused."""
    return Annotated[str, Field(**constraints), AfterValidator(_valid_text)]


Text = _text()
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # and, checked by the engine, below the vocabulary size
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
Real = Annotated[float, Field(allow_inf_nan=False)]
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


StopString = _text(min_length=1, max_length=MAX_STOP_CHARS)
Stop = _one_of("a string or a list of strings", _text_or_list("strings"), string=StopString,
               strings=Annotated[list[StopString], Field(max_length=MAX_STOP)])


class SamplingFields(_Strict):
    """Fields shared by both endpoints; None means the SamplingParams default."""

    model: Text
    n: Annotated[int, Field(ge=1, le=MAX_N, description="completions per prompt; at most the server's --max-n "
                                                        "and --max-num-seqs")] | None = None
    max_tokens: Count | None = None
    temperature: Annotated[Real, Field(ge=0, le=FLOAT32_MAX)] | None = None
    top_p: Annotated[Real, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX, description="0 or -1: off; at or above the vocabulary "
                                                                 "size: every token")] | None = None
    min_p: Annotated[Real, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[Real, Field(gt=0, le=FLOAT32_MAX)] | None = None
    presence_penalty: Annotated[Real, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Real, Field(ge=-2, le=2)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    kv_budget: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = Field(
        None, description="KV tokens kept per sequence; 0 = full KV (zipage extension)")
    eviction_policy: Literal[EVICTION_POLICIES] | None = Field(
        None, description="which tokens a full sequence keeps; default: the server's (zipage extension)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None

    SAMPLING: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
        "include_stop_str_in_output", "kv_budget", "eviction_policy")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for out-of-range values."""
        given = {name: getattr(self, name) for name in self.SAMPLING if getattr(self, name) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


Prompt = _one_of("a string, a list of strings, a list of token ids or a list of token-id lists", _prompt_shape,
                string=NonEmptyText,
                strings=Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)],
                token_ids=Annotated[list[TokenId], Field(min_length=1)],
                token_id_lists=Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                                         Field(min_length=1, max_length=MAX_PROMPTS)])


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: _one_of("a string or a list of text parts", _text_or_list("parts"), string=Text, parts=list[TextPart])
    name: Text | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Count | None = None
