"""llama3_json: Llama 3.1 / 3.2 JSON tool calls. The whole output is the calls: optional
whitespace and <|python_tag|>, then {"name": ..., "parameters": {...}} ("arguments" also read),
several separated by ";". An output that does not start so is content, as written. Each call
(call_object.py) is sent as it is written: its name once known, then its arguments; its object
ends at the bracket that matches its "{". Text after the calls, or from an object in which no
call becomes known on, is content."""

from __future__ import annotations

import json

from zipage_jax.server.tool_parsers.base import ToolCallStream, ToolParser
from zipage_jax.server.tool_parsers.call_object import CallObject

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonStream(ToolCallStream):
    # states: "start" (nothing decided), "object" (in a call's JSON), "separator" (after a call),
    # "next" (after a separator: another call's JSON must follow), "content" (all the rest is text)
    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._held = ""  # text that waits for what follows it ("start", "separator", "next")
        self._call: CallObject | None = None  # in "object": the current call

    def _consume(self, text: str, final: bool) -> None:
        while True:
            state = self._state
            if state == "content":
                self._content(self._held + text)
                self._held = ""
                return
            if state == "object":
                call = self._call
                end = call.feed(text)
                if end is None and not final:
                    self._report(call)
                    return
                self._end_call(call)
                text = "" if end is None else text[end:]
                if call.name is None:  # no call: the text from its "{" on is content
                    self._state, text = "content", call.text + text
                else:
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
        self._state, self._call = "object", CallObject()


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
