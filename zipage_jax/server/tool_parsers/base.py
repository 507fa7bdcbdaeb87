"""What every tool-call parser shares: the pieces of a streamed call, the per-completion stream
a parser feeds text to, and the whole calls of a completion.

A stream is fed a completion's text as it grows and returns what became certain: content (text
outside the calls; a suffix that may start a marker waits for the next text) and pieces of
calls: a call's first piece has its name, sent once the name is known; its next pieces the
arguments' text as the model writes it (call_object.py says when each is known). A call whose
name was sent cannot be taken back: it stays a call whatever follows, with the arguments text
written, valid JSON or not (as when the output ends mid-arguments); one whose JSON breaks before
its name is known is content, as written. Non-streaming extraction is the same stream fed the
whole text at once, so both give the same content and calls (arguments included, character for
character), however the text is split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from zipage_jax.server.tool_parsers.call_object import CallObject


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the arguments' JSON text as the model wrote it


@dataclass
class ToolCallPiece:
    """A piece of a streamed call: its first has the name (and no arguments), the next ones the
    arguments' next text."""

    index: int  # the call's place among its completion's calls
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCallPiece] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.calls += other.calls
        return self


def whole_calls(pieces: list[ToolCallPiece]) -> list[ParsedToolCall]:
    """The calls that a whole completion's pieces make up."""
    names, arguments = [], []
    for piece in pieces:
        if piece.name is not None:
            names.append(piece.name)
            arguments.append("")
        arguments[piece.index] += piece.arguments
    return [ParsedToolCall(name, text) for name, text in zip(names, arguments)]


class ToolCallStream(ABC):
    """One completion's parsing state."""

    def __init__(self) -> None:
        self._pending = ToolDelta()
        self._num_calls = 0  # calls whose name was sent
        self._sent: CallObject | None = None  # the last of them

    def feed(self, text: str) -> ToolDelta:
        """What `text` (the completion's next text) made certain."""
        self._consume(text, final=False)
        return self._take()

    def finish(self) -> ToolDelta:
        """What is left once the completion has ended (held-back text that was no marker, a call's end)."""
        self._consume("", final=True)
        return self._take()

    @abstractmethod
    def _consume(self, text: str, final: bool) -> None:
        """Reads `text` (with `final`, the end of the completion), reporting through _content and _report."""

    def _content(self, text: str) -> None:
        self._pending.content += text

    def _report(self, call: CallObject) -> None:
        """What became known of `call`: its name (once), then its arguments' next text."""
        if call.name is None:
            return
        calls = self._pending.calls
        if call is not self._sent:
            self._sent = call
            calls.append(ToolCallPiece(self._num_calls, call.name))
            self._num_calls += 1
        arguments = call.take_arguments()
        if not arguments:
            return
        if calls and calls[-1].index == self._num_calls - 1 and calls[-1].name is None:
            calls[-1].arguments += arguments
        else:
            calls.append(ToolCallPiece(self._num_calls - 1, arguments=arguments))

    def _end_call(self, call: CallObject) -> None:
        """`call` has ended (its object closed, or the output cut it short)."""
        call.end()
        self._report(call)

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
        return delta.content or None, whole_calls(delta.calls)
