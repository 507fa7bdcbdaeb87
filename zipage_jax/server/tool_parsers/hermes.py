"""hermes: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

after optional text, one block per call. A block ends at the first </tool_call> in it, or at the
end of the output. Its call (call_object.py) is sent as it is written: its name once known, then
its arguments; the text after the call's object in its block is dropped. A block in which no
call becomes known is content, tags included. Content is the text outside the blocks, whitespace
right after a call's block dropped."""

from __future__ import annotations

import json

from zipage_jax.server.partial_markers import held_prefix
from zipage_jax.server.tool_parsers.base import ToolCallStream, ToolParser
from zipage_jax.server.tool_parsers.call_object import CallObject

START, END = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # a possible start of START (outside a block) or of END (inside one)
        self._after_call = False  # blanks here follow a call and are dropped
        self._call: CallObject | None = None  # inside a block: its call
        self._body: list[str] = []  # inside a block: its text, in pieces

    def _consume(self, text: str, final: bool) -> None:
        while True:
            text, self._held = self._held + text, ""
            if self._call is not None:
                at = text.find(END)
                if at >= 0:
                    self._read_body(text[:at])
                    self._end_block(END)
                    text = text[at + len(END):]
                    continue
                keep = held_prefix(text, END)  # not the call's text, even at the end
                self._read_body(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                if final:
                    self._end_block(self._held)
                return
            if self._after_call:
                text = text.lstrip()
                if not text:
                    return
                self._after_call = False
            at = text.find(START)
            if at >= 0:
                self._content(text[:at])
                self._call, text = CallObject(), text[at + len(START):]
                continue
            keep = 0 if final else held_prefix(text, START)
            self._content(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return

    def _read_body(self, text: str) -> None:
        self._body.append(text)
        self._call.feed(text)
        self._report(self._call)

    def _end_block(self, end: str) -> None:
        """The block has ended with `end` (END, or the held text at the end of the output)."""
        call = self._call
        self._end_call(call)
        if call.name is None:  # no call: the block is text, as the model wrote it
            self._content(START + "".join(self._body) + end)
        else:
            self._after_call = True
        self._call, self._body, self._held = None, [], ""


class HermesToolParser(ToolParser):
    name = "hermes"
    arguments_key = "arguments"

    def stream(self) -> HermesStream:
        return HermesStream()

    def grammar(self, call_schema: dict) -> str:
        # any text; once it reaches <tool_call>, a call follows (llguidance's lazy lexeme)
        return "\n".join([
            "start: (call_head call)* TEXT",
            r"TEXT: /(.|\n)*/",
            f"call_head[lazy]: TEXT {json.dumps(START)}",
            f"call: {json.dumps(chr(10))} %json {json.dumps(call_schema)} {json.dumps(chr(10) + END)}",
        ])
