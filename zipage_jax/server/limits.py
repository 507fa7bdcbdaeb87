"""RequestLimits: the per-request counts a server operator may bound (unbounded by default, as
in vLLM), enforced by the handlers with a 400 that names the field and the flag, and written
into the OpenAPI document wherever protocol.py marks a field with that flag.

The engine's own limits (max_model_len, the sampler's widths) are not here: SamplingParams and
the engine refuse those whatever the server allows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import (
    LIMIT_FLAG, MESSAGES_FLAG, PROMPTS_FLAG, STOP_CHARS_FLAG, STOP_STRINGS_FLAG, ChatCompletionRequest, CompletionRequest,
    SamplingFields)


@dataclass(frozen=True)
class RequestLimits:
    """None: unbounded."""

    max_prompts: int | None = None  # prompts in one /v1/completions request
    max_stop_strings: int | None = None
    max_stop_chars: int | None = None  # characters of one stop string
    max_chat_messages: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"{FLAGS[f.name]} must be >= 1 (or not given: unbounded), got {value}")

    def check(self, body: SamplingFields) -> None:
        """OpenAIError 400 for a count of `body` over its bound."""
        if isinstance(body, CompletionRequest):
            _refuse_over("prompt", _num_prompts(body.prompt), self.max_prompts, PROMPTS_FLAG, "{} prompts")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        _refuse_over("stop", len(stop), self.max_stop_strings, STOP_STRINGS_FLAG, "{} strings")
        _refuse_over("stop", max(map(len, stop), default=0), self.max_stop_chars, STOP_CHARS_FLAG,
                     "a string of {} characters")
        if isinstance(body, ChatCompletionRequest):
            self.check_messages(body.messages)

    def check_messages(self, messages: list) -> None:
        _refuse_over("messages", len(messages), self.max_chat_messages, MESSAGES_FLAG, "{} messages")

    def document(self, schemas: dict[str, Any]) -> None:
        """Adds maxItems / maxLength to every schema marked with a flag that has a bound."""
        bounds = {flag: getattr(self, name) for name, flag in FLAGS.items()}
        for node in _nodes(schemas):
            bound = bounds.get(node.get(LIMIT_FLAG))
            if bound is not None:
                node["maxItems" if node.get("type") == "array" else "maxLength"] = bound


FLAGS = {"max_prompts": PROMPTS_FLAG, "max_stop_strings": STOP_STRINGS_FLAG, "max_stop_chars": STOP_CHARS_FLAG,
         "max_chat_messages": MESSAGES_FLAG}  # RequestLimits field -> the server flag that sets it


def _refuse_over(param: str, count: int, bound: int | None, flag: str, holds: str) -> None:
    if bound is not None and count > bound:
        raise OpenAIError(400, f"{param} holds {holds.format(count)}, more than this server's {flag} of {bound}",
                          param=param)


def _num_prompts(prompt: str | list) -> int:
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def _nodes(schema: Any):
    """Every dict in a JSON schema, depth first."""
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from _nodes(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _nodes(value)
