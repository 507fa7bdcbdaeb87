"""Reasoning parsers by name (`zipage-jax serve --reasoning-parser NAME`): each splits one model
family's output into reasoning and content (base.py says how). A new format is one module with
a ReasoningParser subclass, listed here with the tags its reasoning sits between."""

from __future__ import annotations

from zipage_jax.server.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningStream, ReasoningTags
from zipage_jax.server.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from zipage_jax.server.reasoning_parsers.openai_gptoss import GptOssReasoningParser
from zipage_jax.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser

THINK = ReasoningTags("<think>", "</think>")
# each parser's tags: the only place they are written (harmony's: its reasoning tokens are those
# through the first <|end|>)
TAGS: dict[type[ReasoningParser], ReasoningTags] = {
    DeepSeekR1ReasoningParser: THINK, Qwen3ReasoningParser: THINK,
    GptOssReasoningParser: ReasoningTags("<|channel|>analysis<|message|>", "<|end|>")}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser.tagged(tags) for parser, tags in TAGS.items()}

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningStream", "ReasoningTags",
           "get_reasoning_parser"]


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser called `name`; ValueError naming the choices for any other."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
