"""Reasoning parsers by name (`zipage-jax serve --reasoning-parser NAME`): each splits one model
family's output into reasoning and content (base.py says how). A new format is one module with
a ReasoningParser subclass, listed here."""

from __future__ import annotations

from zipage_jax.server.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningStream
from zipage_jax.server.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from zipage_jax.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser called `name`; ValueError naming the choices for any other."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
