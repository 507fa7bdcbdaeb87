"""qwen3: Qwen3, which writes its reasoning as <think>...</think> at the start of the output.
An output that does not start with <think> (blanks aside) is all content; one that opens the
block and never closes it is all reasoning."""

from __future__ import annotations

from zipage_jax.server.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasons_without_start_tag = False
