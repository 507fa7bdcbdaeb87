"""hermes: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

after optional text, one block per call. Content is the text outside the blocks, whitespace
right after a block dropped; a last block left open at the end of the output is a call if its
JSON is complete."""

from __future__ import annotations

import json

from zipage_jax.server.partial_markers import held_prefix
from zipage_jax.server.tool_parsers.base import ToolCallStream, ToolParser, parse_call

START, END = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # outside a call: a possible start of START
        self._after_call = False  # blanks here follow a call and are dropped
        self._body: list[str] | None = None  # inside a call: its body so far, in pieces
        self._tail = ""  # the body's last len(END) - 1 characters, where END may have begun

    def _consume(self, text: str, final: bool) -> None:
        while True:
            if self._body is not None:
                rest = self._read_call(text, final)
                if rest is None:
                    return
                text = rest
                continue
            text, self._held = self._held + text, ""
            if self._after_call:
                text = text.lstrip()
                if not text:
                    return
                self._after_call = False
            at = text.find(START)
            if at >= 0:
                self._content(text[:at])
                self._body, self._tail, text = [], "", text[at + len(START):]
                continue
            keep = 0 if final else held_prefix(text, START)
            self._content(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            return

    def _read_call(self, text: str, final: bool) -> str | None:
        """Adds `text` to the open call's body; once END closes it, the call (or its text, if
        it is no call) is reported and the text after END returned; None while it is open."""
        window = self._tail + text
        at = window.find(END)
        if at < 0:
            self._body.append(text)
            self._tail = window[-(len(END) - 1):]
            if final:  # a last block left open: a call if its JSON is complete
                body = "".join(self._body)
                self._close_call(body[:len(body) - held_prefix(body, END)], body, closed=False)
            return None
        cut = at - len(self._tail)  # where END starts in `text` (< 0: in the body before it)
        body = "".join(self._body)
        body = body + text[:cut] if cut >= 0 else body[:len(body) + cut]
        self._close_call(body, body, closed=True)
        return text[cut + len(END):]

    def _close_call(self, body: str, raw: str, closed: bool) -> None:
        call = parse_call(body)
        if call is None:  # not a call: the block is text, as the model wrote it
            self._content(START + raw + (END if closed else ""))
        else:
            self._call(call)
            self._after_call = True
        self._body = None


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
