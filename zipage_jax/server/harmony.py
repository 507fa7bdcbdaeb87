"""OpenAI's harmony format (gpt-oss), read as it streams: what the openai_gptoss reasoning
parser and the openai tool parser share.

A harmony output is a run of messages, each a header then a body:

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "CET"}<|call|>

A header opens at <|start|> or <|channel|> and closes at <|message|>; it names the channel and,
for a tool call, the recipient (`to=...`, before or after the channel). A body ends at <|end|>,
<|call|> or <|return|>, at a marker that opens the next header, or at the end of the output
(the engine drops <|call|> and <|return|> when they are stop tokens). Text outside the messages
is read as written, as is a header the output leaves unfinished. A tail that may start a marker
waits for the next text, so no piece ever holds part of one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from zipage_jax.server.partial_markers import held_prefix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
OPENERS = (START, CHANNEL)  # open a header
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")  # end a body
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    text: str  # as written, from the marker that opened it through <|message|> (the output's part)
    channel: str | None
    recipient: str | None  # e.g. functions.get_weather

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(text, channel and channel.group(1), recipient and recipient.group(1))


@dataclass(frozen=True)
class Piece:
    """What the reader made certain: text outside the messages, a header, a body's next text, or
    a body's end (its terminator as written, "" when the output or the next header ended it)."""

    kind: Literal["text", "header", "body", "end"]
    text: str
    header: Header | None = None  # with kind "header"


class HarmonyReader:
    """One output's reading state: "outside" (between messages), "header" or "body"."""

    def __init__(self, prompt_tail: str = "") -> None:
        """prompt_tail: the end of the prompt, from the message it opens on (the chat template's
        <|start|>assistant): read first, not reported, except for a header it completes (its
        first piece, with no text); a header it opens is reported without the prompt's part."""
        self._state = "outside"
        self._held = ""  # a possible start of a marker, or the header so far
        self._prompt_chars = 0  # how much of the header so far is the prompt's
        self._opened: list[Piece] = []  # the header the prompt completed, for the first feed
        headers = [piece.header for piece in self.feed(prompt_tail) if piece.kind == "header"]
        self._opened = [Piece("header", "", headers[-1])] if headers and self._state == "body" else []
        self._prompt_chars = len(self._held) if self._state == "header" else 0

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        """The pieces `text` (the output's next text; with `final`, its end) made certain."""
        text, self._held = self._held + text, ""
        pieces, self._opened = self._opened, []
        while True:
            if self._state == "header":
                at = text.find(MESSAGE)
                if at < 0:
                    if final:  # an unfinished header: text as written
                        self._state = "outside"
                        written, self._prompt_chars = text[self._prompt_chars:], 0
                        pieces += [Piece("text", written)] if written else []
                    else:
                        self._held = text
                    return pieces
                parsed = Header.parse(text[:at + len(MESSAGE)])
                header = Header(parsed.text[self._prompt_chars:], parsed.channel, parsed.recipient)
                pieces.append(Piece("header", header.text, header))
                self._state, self._prompt_chars, text = "body", 0, text[at + len(MESSAGE):]
                continue
            in_body = self._state == "body"
            kind = "body" if in_body else "text"
            markers = OPENERS + TERMINATORS if in_body else OPENERS
            found = [(text.find(marker), marker) for marker in markers if marker in text]
            if found:
                at, marker = min(found)
                if at:
                    pieces.append(Piece(kind, text[:at]))
                if in_body:
                    pieces.append(Piece("end", marker if marker in TERMINATORS else ""))
                if marker in OPENERS:
                    self._state, text = "header", text[at:]
                else:
                    self._state, text = "outside", text[at + len(marker):]
                continue
            keep = 0 if final else max(held_prefix(text, marker) for marker in markers)
            if len(text) > keep:
                pieces.append(Piece(kind, text[:len(text) - keep]))
            self._held = text[len(text) - keep:]
            if final and in_body:
                pieces.append(Piece("end", ""))
                self._state = "outside"
            return pieces
