"""Chat messages to prompt token ids with the tokenizer's chat template.

The messages are OpenAI-shaped dicts; a tool call's `function.arguments` may be JSON text (as
OpenAI sends it) and reaches the template as the object it encodes, since templates render it
with `arguments | tojson`. `chat_template_kwargs` are extra variables for the template (e.g.
Qwen3's `enable_thinking`); names the renderer sets itself are refused (RESERVED_TEMPLATE_KWARGS).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

_RENDERER_INPUTS = ("messages", "documents")
_OWN_OPTIONS = ("tools", "add_generation_prompt", "continue_final_message")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                   "additional_special_tokens", "extra_special_tokens")
_TEMPLATE_FUNCTIONS = ("raise_exception", "strftime_now", "range", "dict", "namespace", "cycler", "joiner", "lipsum")
_RENDERER_OPTIONS = ("conversation", "chat_template", "tokenize", "sanitize_control_tokens", "padding", "truncation",
                     "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
# Each name a chat_template_kwargs key may not be, and why.
RESERVED_TEMPLATE_KWARGS: dict[str, str] = {
    **dict.fromkeys(_RENDERER_INPUTS, "the renderer sets it"),
    **dict.fromkeys(_OWN_OPTIONS, "it is an option of its own, not one of chat_template_kwargs"),
    **dict.fromkeys(_SPECIAL_TOKENS, "the tokenizer passes its special token under this name"),
    **dict.fromkeys(_TEMPLATE_FUNCTIONS, "it names a function templates call"),
    **dict.fromkeys(_RENDERER_OPTIONS, "it is an option of transformers' apply_chat_template, not a template variable"),
}
# What a template may raise on inputs it does not expect (a client's variable of another type, say).
_TEMPLATE_FAILURES = (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError)


def chat_prompt_ids(tokenizer, messages: list[dict], max_length: int | None = None, *,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` rendered with the model's template (at most the first `max_length`
    of them, if given); the other options as chat_prompt_text's.

    Raises ValueError naming the problem (empty messages, no template, template rejection)."""
    text = chat_prompt_text(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
    limit = {} if max_length is None else {"truncation": True, "max_length": max_length}
    return list(tokenizer(text, add_special_tokens=False, **limit)["input_ids"])


def chat_prompt_text(tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """`messages` rendered with the model's template: `tools` go to it as `tools`, each of
    `chat_template_kwargs` as a variable of that name; `add_generation_prompt` appends the start
    of an assistant turn, `continue_final_message` leaves the last message open instead (not both).

    Raises ValueError as chat_prompt_ids."""
    if not messages:
        raise ValueError("messages is empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    variables = check_chat_template_kwargs(chat_template_kwargs or {})
    template_messages = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(template_messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **variables)
    except _TEMPLATE_FAILURES as exc:
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc


def check_chat_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs`, unless it is not a dict of names or a key is reserved (ValueError naming it and why)."""
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"chat_template_kwargs must be a dict of variable names to values, got {kwargs!r:.50}")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{key!r} cannot be a chat_template_kwargs key: {RESERVED_TEMPLATE_KWARGS[key]}")
    return kwargs


def tool_call_arguments(text: str) -> dict[str, Any]:
    """A tool call's arguments, JSON text of an object ("" for none), as that object (ValueError otherwise)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text[:50]!r}")
    return value


def _template_message(message: dict, index: int) -> dict:
    """`message` with each tool call's JSON-text arguments as the object they encode, and no
    content (an assistant's that only calls tools) as "" (templates concatenate it)."""
    if message["content"] is None:
        message = {**message, "content": ""}
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [_with_object_arguments(call, f"messages[{index}].tool_calls[{i}]")
                                      for i, call in enumerate(calls)]}


def _with_object_arguments(call: Any, where: str) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = tool_call_arguments(function["arguments"])
    except ValueError as exc:
        raise ValueError(f"{where}.function.arguments: {exc}") from exc
    return {**call, "function": {**function, "arguments": arguments}}
