"""What the reasoning parsers share: a completion's text split into the reasoning (between
the parser's start and end tags, the registry's table gives each parser its own: <think> and
</think> below) and the content (the rest), as it arrives, with the tags dropped.

The reasoning is kept as written; the blanks between the end tag and the content (Qwen3 writes
"</think>\n\n") are dropped, as the chat templates drop them from earlier turns.

A parser is made per request from the end of its prompt: a chat template may open the think
block itself (the prompt ends with <think>: the output starts in the reasoning) or close it
(it ends with </think>, as Qwen3's with enable_thinking off: the output is all content);
otherwise the output's start decides, as the parser says. A tail of the reasoning that may start
the end tag (or a start that may become the start tag) waits for the next text, so no part of a
tag is ever sent; an output that ends inside the reasoning is all reasoning. Non-streaming
extraction is the same stream fed the whole text at once.

Reasoning tokens are counted from token ids when the tokenizer has the end tag as one token
(Qwen3, DeepSeek-R1): the tokens up to and including the first one of it; otherwise from the
text: the fewest leading tokens whose decoded text holds the end tag. An unclosed reasoning
counts every generated token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import llguidance

from zipage_jax.server.partial_markers import held_prefix

PROMPT_TAIL_TOKENS = 32  # enough for a template's "<think>\n\n</think>\n\n" in byte-sized tokens


class ReasoningTags(NamedTuple):
    start: str  # opens the reasoning, e.g. <think>
    end: str  # closes it, e.g. </think>


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser:
    """One request's reasoning format."""

    name: ClassVar[str]  # the --reasoning-parser value
    tags: ClassVar[ReasoningTags]  # set by `tagged`, from the registry's table
    # an output that does not start with the start tag is reasoning (DeepSeek-R1: the template opened
    # the block) rather than content (Qwen3)
    reasons_without_start_tag: ClassVar[bool]
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens: decode the output with them

    def __init__(self, prompt_opened: bool | None = None):
        """prompt_opened: True if the prompt opened the think block, False if it closed it, None if neither."""
        self.prompt_opened = prompt_opened

    @classmethod
    def tagged(cls, tags: ReasoningTags) -> type[ReasoningParser]:
        """This format with its reasoning between `tags`; ValueError for an empty tag."""
        if not tags.start or not tags.end:
            raise ValueError(f"reasoning tags must not be empty, got {tags}")
        return type(cls.__name__, (cls,), {"tags": tags})

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], tokenizer: Any) -> ReasoningParser:
        """The parser of a request whose prompt (a rendered chat) is `prompt_token_ids`."""
        tail = tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:]).rstrip()
        return cls(True if tail.endswith(cls.tags.start) else False if tail.endswith(cls.tags.end) else None)

    def stream(self) -> ReasoningStream:
        """A new completion's splitting state."""
        return ReasoningStream(self)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """The reasoning and the content of a whole completion (None where empty)."""
        stream = self.stream()
        delta = stream.feed(text)
        delta += stream.finish()
        return delta.reasoning or None, delta.content or None

    def grammar(self, answer: str) -> str:
        """A Lark grammar (llguidance's dialect) of this format's reasoning, then up to four
        blanks and `answer` (a rule body: %json {...}, %lark {...}, a regex, literals). Where the
        reasoning is optional (qwen3, the prompt deciding nothing) and the answer may start as
        free text (a strict tool's grammar), the grammar cannot tell them apart: a <tool_call>
        written inside such reasoning starts a call."""
        lines = [f"answer: {answer}", r"BLANKS: /\s{0,4}/"]
        if self.prompt_opened is False:
            return "\n".join(["start: answer", *lines])
        ends = f"(.|\\n)*{_lark_regex(self.tags.end)}"
        if self.prompt_opened or self.reasons_without_start_tag:
            return "\n".join(["start: reasoning BLANKS answer", f"reasoning[lazy]: /{ends}/", *lines])
        starts = f"\\s*{_lark_regex(self.tags.start)}"
        return "\n".join(["start: (reasoning BLANKS)? answer", f"reasoning[lazy]: /{starts}{ends}/", *lines])

    def reasoning_tokens(self, token_ids: list[int], ended: bool | None, tokenizer: Any) -> int:
        """How many of a completion's `token_ids` are its reasoning, tags included; `ended`: its
        stream's `ended` once finished."""
        if ended is None:
            return 0
        if not ended:
            return len(token_ids)
        end = self.tags.end
        end_id = tokenizer.convert_tokens_to_ids(end)
        if isinstance(end_id, int) and tokenizer.decode([end_id]) == end and end_id in token_ids:
            return token_ids.index(end_id) + 1
        low, high = 1, len(token_ids)  # the fewest leading tokens whose text holds the end tag
        while low < high:
            middle = (low + high) // 2
            if end in tokenizer.decode(token_ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return high


class ReasoningStream:
    """One completion's state: "start" (undecided), "reasoning" or "content"."""

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._state = {None: "start", True: "reasoning", False: "content"}[parser.prompt_opened]
        self._buffer = ""  # text not reported yet
        self._after_reasoning = False  # blanks here follow the end tag and are dropped
        self._pending = ReasoningDelta()
        self.ended: bool | None = False if parser.prompt_opened else None  # None: no reasoning; True: closed

    def feed(self, text: str) -> ReasoningDelta:
        """What `text` (the completion's next text) made certain."""
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The held-back rest once the completion has ended."""
        self._consume("", final=True)
        return self._take()

    def _consume(self, text: str, final: bool) -> None:
        start, end = self._parser.tags
        self._buffer += text
        while True:
            if self._state == "content":
                if self._after_reasoning:
                    self._buffer = self._buffer.lstrip()
                    self._after_reasoning = not self._buffer
                self._pending.content += self._buffer
                self._buffer = ""
                return
            if self._state == "start":
                rest = self._buffer.lstrip()
                if rest.startswith(start):
                    self._buffer = rest[len(start):]
                    self._start_reasoning()
                elif start.startswith(rest) and not final:  # empty, or the tag's beginning
                    return
                elif self._parser.reasons_without_start_tag:
                    self._start_reasoning()
                else:
                    self._state = "content"
                continue
            at = self._buffer.find(end)
            if at >= 0:
                self._pending.reasoning += self._buffer[:at]
                self._buffer = self._buffer[at + len(end):]
                self._state, self.ended, self._after_reasoning = "content", True, True
                continue
            keep = 0 if final else held_prefix(self._buffer, end)
            self._pending.reasoning += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return

    def _start_reasoning(self) -> None:
        self._state, self.ended = "reasoning", False

    def _take(self) -> ReasoningDelta:
        pending, self._pending = self._pending, ReasoningDelta()
        return pending


def _lark_regex(literal: str) -> str:
    """A regex matching `literal`, written for Lark's /.../."""
    return llguidance.regex_to_lark(re.escape(literal), "")
