"""Tool-call parsers by name (`zipage-jax serve --tool-call-parser NAME`): each reads one model
family's tool-call format out of the generated text (base.py says how). A new format is one
module with a ToolParser subclass, listed here."""

from __future__ import annotations

from zipage_jax.server.tool_parsers.base import (
    ParsedToolCall,
    ToolCallPiece,
    ToolCallStream,
    ToolDelta,
    ToolParser,
    whole_calls,
)
from zipage_jax.server.tool_parsers.hermes import HermesToolParser
from zipage_jax.server.tool_parsers.llama3_json import Llama3JsonToolParser
from zipage_jax.server.tool_parsers.openai import OpenAIToolParser
from zipage_jax.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,
                                                                                Llama3JsonToolParser,
                                                                                OpenAIToolParser,
                                                                                PythonicToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolCallPiece", "ToolCallStream", "ToolDelta", "ToolParser",
           "get_tool_parser", "whole_calls"]


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser called `name`; ValueError naming the choices for any other."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
