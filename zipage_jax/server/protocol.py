"""Request bodies of the OpenAI API (plus vLLM's sampling extensions), validated strictly.

Unknown fields are rejected rather than ignored, so a misspelt or unsupported option is an
error the client sees, not a silent default.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from zipage_jax.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by both endpoints; None means the SamplingParams default."""

    model: str
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    kv_budget: int | None = Field(None, description="KV tokens kept per sequence; 0 = full KV (zipage extension)")
    eviction_policy: str | None = Field(None, description="which tokens a full sequence keeps: zipage, streaming, "
                                        "window or vnorm-window; default: the server's (zipage extension)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

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


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
