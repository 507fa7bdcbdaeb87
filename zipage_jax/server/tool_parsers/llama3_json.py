"""llama3_json: Llama 3.1 / 3.2 JSON tool calls. The whole output is the calls: optional
whitespace and <|python_tag|>, then {"name": ..., "parameters": {...}} ("arguments" also read),
several separated by ";". An output that does not start so is content, as written. Calls are
read while they come; text after them (or from a malformed one on) is content."""

from __future__ import annotations

import json

from zipage_jax.server.tool_parsers.base import ToolCallStream, ToolParser, parse_call

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class ObjectEnd:
    """Finds where a JSON object ends, fed its text from its "{" on in pieces (strings and
    escapes followed, so braces inside strings do not count)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the object's closing brace, or None if it is not there."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch == "{":
                self._depth += 1
            elif ch == "}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class Llama3JsonStream(ToolCallStream):
    # states: "start" (nothing decided), "object" (in a call's JSON), "separator" (after a call),
    # "next" (after a separator: another call's JSON must follow), "content" (all the rest is text)
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._held = ""  # text that waits for what follows it ("start", "separator", "next")
        self._object: list[str] = []  # the current call's JSON so far, in pieces
        self._end = ObjectEnd()

    def _consume(self, text: str, final: bool) -> None:
        while True:
            state = self._state
            if state == "content":
                self._content(self._held + text)
                self._held = ""
                return
            if state == "object":
                end = self._end.feed(text)
                if end is None:
                    self._object.append(text)
                    if not final:
                        return
                    self._state, text = "content", "".join(self._object)  # cut short: text
                    continue
                raw, text = "".join(self._object) + text[:end], text[end:]
                call = parse_call(raw)
                if call is None:
                    self._state, text = "content", raw + text
                    continue
                self._call(call)
                self._state = "separator"
                continue
            text, self._held = self._held + text, ""
            rest = text.lstrip()
            if state == "start":
                if rest.startswith(PYTHON_TAG):
                    rest = rest[len(PYTHON_TAG):].lstrip()
                    if not rest and not final:
                        self._held = text
                        return
                elif PYTHON_TAG.startswith(rest) and not final:  # empty, or the tag's beginning
                    self._held = text
                    return
                if rest.startswith("{"):
                    self._start_object()
                    text = rest
                else:
                    self._state = "content"  # no call: the output as written
                continue
            if not rest:  # "separator" or "next": wait for what follows the blanks
                self._held = "" if final else text
                return
            if state == "separator" and rest.startswith(SEPARATOR):
                self._state, text = "next", rest[len(SEPARATOR):]
            elif state == "next" and rest.startswith("{"):
                self._start_object()
                text = rest
            else:
                self._state, text = "content", rest

    def _start_object(self) -> None:
        self._state, self._object, self._end = "object", [], ObjectEnd()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    def grammar(self, call_schema: dict) -> str:
        # text whose first non-blank character is not "{", or calls
        return "\n".join([
            "start: TEXT | call (SEPARATOR call)*",
            r"TEXT: /\s*([^{\s](.|\n)*)?/",
            f"SEPARATOR: {json.dumps(SEPARATOR + ' ')}",
            f"call: %json {json.dumps(call_schema)}",
        ])
