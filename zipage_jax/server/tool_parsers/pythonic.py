"""pythonic: tool calls written as one Python list of calls, the whole output (Gemma 3, Llama 3.2
and 4 with their pythonic templates):

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

Each call is a function name and keyword arguments whose values are literals (strings, numbers,
True/False/None, lists, dicts); the arguments are sent as the JSON object they make. The text is
read with `ast` and `ast.literal_eval`, never run. An output whose first non-blank character is
"[" is held to its end, then read: calls if it is such a list, content as written otherwise;
any other output is content as it streams. Strict tools are refused: their grammar would be
Python, not JSON."""

from __future__ import annotations

import ast
import json

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.tool_parsers.base import ParsedToolCall, ToolCallPiece, ToolCallStream, ToolParser


def python_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls `text` is a list of, or None if it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON's
            return None
    return calls


class PythonicStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._held: str | None = ""  # the output so far while it may be calls; None once it is content

    def _consume(self, text: str, final: bool) -> None:
        if self._held is None:
            self._content(text)
            return
        self._held += text
        start = self._held.lstrip()
        if start and not start.startswith("["):
            self._content(self._held)
            self._held = None
        elif final:
            calls = python_calls(self._held)
            if calls is None:
                self._content(self._held)
            for index, call in enumerate(calls or ()):
                self._pending.calls += [ToolCallPiece(index, call.name), ToolCallPiece(index, arguments=call.arguments)]
            self._held = None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    arguments_key = "arguments"

    def stream(self) -> PythonicStream:
        return PythonicStream()

    def grammar(self, call_schema: dict) -> str:
        raise OpenAIError(400, f"--tool-call-parser {self.name} cannot constrain a strict tool's calls (they are "
                               "Python, not JSON): send the tool without strict", param="tools")
