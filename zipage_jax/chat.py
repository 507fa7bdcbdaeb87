"""Chat messages to prompt token ids with the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError


def chat_prompt_ids(tokenizer, messages: list[dict], max_length: int | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` rendered with the model's template plus the generation prompt
    (at most the first `max_length` of them, if given); `tools` go to the template as `tools`.

    Raises ValueError naming the problem (empty messages, no template, template rejection)."""
    limit = {} if max_length is None else {"truncation": True, "max_length": max_length}
    ids = _render(tokenizer, messages, add_generation_prompt=True, tokenize=True, tools=tools, **limit)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_prompt_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """`messages` rendered with the model's template (raises as chat_prompt_ids)."""
    return _render(tokenizer, messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def _render(tokenizer, messages: list[dict], **options: Any) -> Any:
    if not messages:
        raise ValueError("messages is empty")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except TemplateError as exc:
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc
