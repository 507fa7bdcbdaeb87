"""RequestLimits: the per-request counts a server operator may bound, enforced with a 400 that
names the field and the flag, and written into the OpenAPI document wherever protocol.py marks
a field with that flag. Prompts and stop strings are unbounded by default, as in vLLM, and
checked by the handlers. Chat messages have generous bounds, checked before the template
renders them (its cost grows with their number and their text): their number while the body
is parsed, their text in the Preprocessor.

The engine's own limits (max_model_len, the sampler's widths) are not here: SamplingParams and
the engine refuse those whatever the server allows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from zipage_jax.config import option
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import (
    LIMIT_FLAG,
    MESSAGES_BOUND,
    MESSAGES_FLAG,
    PROMPTS_FLAG,
    STOP_CHARS_FLAG,
    STOP_STRINGS_FLAG,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)

CHAT_BYTES_FLAG = "--max-chat-bytes"
MESSAGE_OVERHEAD_BYTES = 32  # what a template adds around each message (role, delimiters), roughly
DEFAULT_MAX_CHAT_MESSAGES = 10_000
DEFAULT_MAX_CHAT_BYTES = 2 * 2**20


@dataclass(frozen=True)
class RequestLimits:
    """None: unbounded. A count over its bound is answered 400."""

    max_prompts: int | None = option(
        None, flag=PROMPTS_FLAG, metavar="N",
        doc="the most prompts in one /v1/completions request (without a bound, any number are queued under "
            "--max-num-seqs); more is answered 400; default: unbounded")
    max_stop_strings: int | None = option(
        None, flag=STOP_STRINGS_FLAG, metavar="N",
        doc="the most stop strings in one request (each costs the stop checker work per generated token: bound it "
            "when clients are not trusted); more is answered 400; default: unbounded")
    max_stop_chars: int | None = option(
        None, flag=STOP_CHARS_FLAG, metavar="N",
        doc="the most characters in one stop string; more is answered 400; default: unbounded")
    max_chat_messages: int | None = option(
        DEFAULT_MAX_CHAT_MESSAGES, flag=MESSAGES_FLAG, metavar="N",
        doc="the most messages in one chat request (and in /tokenize's chat form); more is answered 400")
    max_chat_bytes: int | None = option(
        DEFAULT_MAX_CHAT_BYTES, flag=CHAT_BYTES_FLAG, metavar="N",
        doc="the most bytes of text in one chat request's messages (and in /tokenize's chat form): every string "
            f"field of every message, plus {MESSAGE_OVERHEAD_BYTES} per message, counted before the template "
            "renders them; more is answered 400")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"{f.metadata['flag']} must be >= 1, got {value}")

    def check(self, body: SamplingFields) -> None:
        """OpenAIError 400 for a count of `body` over its bound."""
        if isinstance(body, CompletionRequest):
            _refuse_over("prompt", num_prompts(body.prompt), self.max_prompts, PROMPTS_FLAG, "{} prompts")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        _refuse_over("stop", len(stop), self.max_stop_strings, STOP_STRINGS_FLAG, "{} strings")
        _refuse_over("stop", max(map(len, stop), default=0), self.max_stop_chars, STOP_CHARS_FLAG,
                     "a string of {} characters")

    def validation_context(self) -> dict[str, Any]:
        """What request bodies are validated with: max_chat_messages is checked while parsing,
        before each message is validated."""
        return {MESSAGES_BOUND: self.max_chat_messages}

    def check_chat_bytes(self, messages: list[ChatMessage]) -> None:
        """OpenAIError 400 if the messages' text is over max_chat_bytes; O(their text), so it runs
        off the event loop, before the template."""
        _refuse_over("messages", chat_bytes(messages), self.max_chat_bytes, CHAT_BYTES_FLAG,
                     f"{{}} bytes of text (with {MESSAGE_OVERHEAD_BYTES} per message)")

    def document(self, schemas: dict[str, Any]) -> None:
        """Adds maxItems / maxLength to every schema marked with a flag that has a bound."""
        bounds = {f.metadata["flag"]: getattr(self, f.name) for f in fields(self)}
        for node in _nodes(schemas):
            bound = bounds.get(node.get(LIMIT_FLAG))
            if bound is not None:
                node["maxItems" if node.get("type") == "array" else "maxLength"] = bound


def chat_bytes(messages: list[ChatMessage]) -> int:
    """The UTF-8 bytes a chat template renders the messages from, estimated before rendering."""
    return sum(m.text_bytes() + MESSAGE_OVERHEAD_BYTES for m in messages)


def _refuse_over(param: str, count: int, bound: int | None, flag: str, holds: str) -> None:
    if bound is not None and count > bound:
        raise OpenAIError(400, f"{param} holds {holds.format(count)}, more than this server's {flag} of {bound}",
                          param=param)


def num_prompts(prompt: str | list) -> int:
    """The prompts of a /v1/completions request (one string or token-id list, or a list of them)."""
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
