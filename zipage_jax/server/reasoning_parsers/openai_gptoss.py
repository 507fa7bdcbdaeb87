"""openai_gptoss: gpt-oss, which writes OpenAI's harmony format (harmony.py). The bodies of the
analysis channel's messages are reasoning; those of the other messages are content (the final
channel's answer, a commentary preamble), except that a message to a recipient (a tool call) is
content as written, header and terminator included, for the openai tool parser to read. Text
outside the messages is content as written. The chat template ends the prompt with
<|start|>assistant, so the output starts inside a header; the prompt's own end decides that.

Harmony's markers are special tokens, so the output is decoded with them. Structured outputs
are refused: their grammar would have to spell out harmony's special tokens."""

from __future__ import annotations

from typing import Any

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.harmony import START, HarmonyReader
from zipage_jax.server.reasoning_parsers.base import PROMPT_TAIL_TOKENS, ReasoningDelta, ReasoningParser


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    reasons_without_start_tag = False
    needs_special_tokens = True

    def __init__(self, prompt_tail: str = ""):
        """prompt_tail: the prompt from its last <|start|> on (the message it opens), "" if none."""
        super().__init__(None)
        self.prompt_tail = prompt_tail

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], tokenizer: Any) -> GptOssReasoningParser:
        tail = tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        at = tail.rfind(START)
        return cls(tail[at:] if at >= 0 else "")

    def stream(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(self.prompt_tail)

    def grammar(self, answer: str) -> str:
        raise OpenAIError(400, f"--reasoning-parser {self.name} (the harmony format) cannot be combined with "
                               "response_format, structured_outputs, a tool_choice that forces a call or a strict tool")


class HarmonyReasoningStream:
    """One completion's state; `ended` as ReasoningStream's (None: no analysis message yet;
    False: one is open; True: the last one ended at its terminator)."""

    def __init__(self, prompt_tail: str):
        self._reader = HarmonyReader(prompt_tail)
        self._route = "content"  # where the current body goes: "reasoning", "content" or "as written"
        self.ended: bool | None = None
        self._pending = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        """What `text` (the completion's next text) made certain."""
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The held-back rest once the completion has ended."""
        self._consume("", final=True)
        return self._take()

    def _consume(self, text: str, final: bool) -> None:
        pending = self._pending
        for piece in self._reader.feed(text, final):
            if piece.kind == "header":
                header = piece.header
                if header.channel == "analysis" and header.recipient is None:
                    self._route, self.ended = "reasoning", False
                elif header.recipient is not None:
                    self._route = "as written"
                    pending.content += piece.text
                else:
                    self._route = "content"
            elif piece.kind == "text":
                pending.content += piece.text
            elif self._route == "reasoning":
                if piece.kind == "body":
                    pending.reasoning += piece.text
                else:  # ended by its terminator or the next header, not cut off by the output's end
                    self.ended = bool(piece.text) or not final
            elif piece.kind == "body" or self._route == "as written":
                pending.content += piece.text

    def _take(self) -> ReasoningDelta:
        pending, self._pending = self._pending, ReasoningDelta()
        return pending
