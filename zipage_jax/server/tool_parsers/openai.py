"""openai: gpt-oss's tool calls, messages of OpenAI's harmony format (harmony.py) to a function
on the commentary channel:

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message whose recipient is functions.NAME is a call of NAME, sent once its header is read;
its body, as written, is the arguments (`{}` if empty), sent as it is written. Everything else
(other messages, headers and terminators included, and the text between them) is content as
written: with the openai_gptoss reasoning parser, which takes the analysis channel and leaves
the bodies of the other messages, that is the answer. Strict tools are refused: their grammar
would have to spell out harmony's special tokens."""

from __future__ import annotations

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.harmony import HarmonyReader, Header
from zipage_jax.server.tool_parsers.base import ToolCallPiece, ToolCallStream, ToolParser

FUNCTIONS = "functions."  # the recipient prefix of a function call


def called_function(header: Header) -> str | None:
    """The function a message with `header` calls, if any."""
    recipient = header.recipient or ""
    name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else ""
    return name or None


class OpenAIToolStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()
        self._in_call = False  # reading a call's body
        self._has_arguments = False  # the call's body has text

    def _consume(self, text: str, final: bool) -> None:
        for piece in self._reader.feed(text, final):
            if piece.kind == "header" and called_function(piece.header):
                self._pending.calls.append(ToolCallPiece(self._num_calls, called_function(piece.header)))
                self._num_calls += 1
                self._in_call, self._has_arguments = True, False
            elif not self._in_call:
                self._content(piece.text)
            elif piece.kind == "body":
                self._add_arguments(piece.text)
                self._has_arguments = True
            else:  # the call's end
                if not self._has_arguments:
                    self._add_arguments("{}")
                self._in_call = False

    def _add_arguments(self, text: str) -> None:
        calls, index = self._pending.calls, self._num_calls - 1
        if calls and calls[-1].index == index and calls[-1].name is None:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallPiece(index, arguments=text))


class OpenAIToolParser(ToolParser):
    name = "openai"
    arguments_key = "arguments"

    def stream(self) -> OpenAIToolStream:
        return OpenAIToolStream()

    def grammar(self, call_schema: dict) -> str:
        raise OpenAIError(400, f"--tool-call-parser {self.name} (the harmony format) cannot constrain a strict "
                               "tool's calls: send the tool without strict", param="tools")
