"""What every tool-call parser shares: the parsed call, the per-completion stream a parser feeds
text to, and the call JSON both parsers read.

A stream is fed a completion's text as it grows and returns what became certain: content
(text outside the calls; a suffix that may start a marker waits for the next text) and whole
calls. A call is returned once its JSON is complete and valid, never in pieces, so a call is
never sent and then found to be malformed; a tag whose JSON is malformed is content, tag
included. Non-streaming extraction is the same stream fed the whole text at once, so both
give the same content and calls, however the text is split.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object: json.dumps of the arguments the model wrote


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallStream(ABC):
    """One completion's parsing state."""

    def __init__(self) -> None:
        self._pending = ToolDelta()

    def feed(self, text: str) -> ToolDelta:
        """What `text` (the completion's next text) made certain."""
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> ToolDelta:
        """What is left once the completion has ended (held-back text that was no marker, a last call)."""
        self._consume("", final=True)
        return self._take()

    @abstractmethod
    def _consume(self, text: str, final: bool) -> None:
        """Reads `text` (with `final`, the end of the completion), reporting through _content and _call."""

    def _content(self, text: str) -> None:
        self._pending.content += text

    def _call(self, call: ParsedToolCall) -> None:
        self._pending.calls.append(call)

    def _take(self) -> ToolDelta:
        pending, self._pending = self._pending, ToolDelta()
        return pending


class ToolParser(ABC):
    """A model family's tool-call format: its streams, and a grammar of free text and calls."""

    name: ClassVar[str]  # the --tool-call-parser value
    arguments_key: ClassVar[str]  # the key of the arguments in the call objects its models write

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new completion's parsing state."""

    @abstractmethod
    def grammar(self, call_schema: dict) -> str:
        """A Lark grammar (llguidance's dialect) of any output this parser reads, each call's
        JSON following `call_schema`."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """The content (None if empty) and calls of a whole completion."""
        stream = self.stream()
        delta = stream.feed(text)
        delta += stream.finish()
        return delta.content or None, delta.calls


def parse_call(text: str) -> ParsedToolCall | None:
    """The call a JSON object {"name": ..., "arguments" or "parameters": {...}} describes; None if
    `text` is not such an object. Absent arguments are {}; arguments given as the JSON text of an
    object are read as that object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
