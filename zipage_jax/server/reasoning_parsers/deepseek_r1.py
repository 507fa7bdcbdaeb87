"""deepseek_r1: DeepSeek-R1 and the models distilled from it (QwQ, Qwen3 thinking templates that
open the block in the prompt). Everything up to </think> is reasoning, whether or not the output
repeats the <think> the template opened; an output without </think> is all reasoning."""

from __future__ import annotations

from zipage_jax.server.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    reasons_without_start_tag = True
