"""One tool call's JSON object, {"name": ..., "arguments": {...}} ("parameters" also read), read
as the model writes it.

The name is known once its string has closed, if the object so far is valid JSON and no
arguments key came before it. From then on the arguments are known as they are written: the
raw text of their object value, from its "{" to the matching "}" (bracket matching that skips
strings); arguments written as a string are the text it holds, known once it has closed. A call
that writes its arguments before its name is known once its object has closed, if the object is
a call (a non-empty string name; arguments absent, an object, or a string holding one). Once its
name is known the call stands, whatever follows: its arguments are the text written (valid JSON
or not), `{}` if there was none.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # the first one written is read


class CallObject:
    """One call, fed its text (blanks, then its "{" ...) in pieces; what follows its object's
    end is not read."""

    def __init__(self) -> None:
        self.name: str | None = None  # once known, the call stands
        self.closed = False  # its object has ended, or the text was no object
        self._chunks: list[str] = []  # the text read
        self._length = 0
        self._arguments: list[str] = []  # the arguments' text so far, in pieces
        self._taken = 0  # how many of those pieces take_arguments has returned
        self._depth = 0  # brackets open
        self._in_string = self._escaped = False
        self._string_at = 0  # where the string being read began
        self._expect_key = False  # at depth 1: the next string is a key (else a value)
        self._key: str | None = None  # at depth 1: the key whose value is being read
        self._arguments_seen = False  # an arguments key has been written
        self._in_arguments = False  # reading the arguments' object

    @property
    def text(self) -> str:
        """The text read."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def take_arguments(self) -> str:
        """The arguments' text known since the last take (none before the name is known)."""
        if self.name is None:
            return ""
        new = "".join(self._arguments[self._taken:])
        self._taken = len(self._arguments)
        return new

    def end(self) -> None:
        """The call has ended (its object closed, or the output cut it short)."""
        if self.name is not None and not self._arguments:
            self._arguments.append("{}")

    def feed(self, text: str) -> int | None:
        """Reads `text`: the index in it where the reading stopped (just past the object's end),
        or None if the object goes on."""
        if self.closed:
            return 0
        start = self._length
        self._chunks.append(text)
        self._length += len(text)
        arguments_from = 0 if self._in_arguments else None  # where the arguments' text in `text` begins
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 1:
                        self._read_string(start + i + 1)
            elif self._depth == 0:  # before the object
                if ch == "{":
                    self._depth, self._expect_key = 1, True
                elif not ch.isspace():
                    self._close(start + i)  # no object
                    return i
            elif ch == '"':
                self._in_string, self._string_at = True, start + i
            elif ch in "{[":
                self._depth += 1
                if self._depth == 2 and ch == "{" and not self._expect_key and self._key in ARGUMENT_KEYS:
                    self._in_arguments, arguments_from = True, i
            elif ch in "}]":
                self._depth -= 1
                if self._in_arguments and self._depth == 1:
                    self._arguments.append(text[arguments_from:i + 1])
                    self._in_arguments, arguments_from, self._key = False, None, None
                if self._depth == 0:
                    self._close(start + i + 1)
                    return i + 1
            elif self._depth == 1 and ch in ",:":
                self._expect_key = ch == ","
        if arguments_from is not None and arguments_from < len(text):
            self._arguments.append(text[arguments_from:])
        return None

    def _read_string(self, end: int) -> None:
        """A string at depth 1 has closed at `end`: a key, or the value of self._key."""
        try:
            value = json.loads(self.text[self._string_at:end])
        except ValueError:  # an invalid escape
            value = None
        if self._expect_key:
            is_arguments = value in ARGUMENT_KEYS
            self._key = None if is_arguments and self._arguments_seen else value
            self._arguments_seen |= is_arguments
            return
        key, self._key = self._key, None
        if key in ARGUMENT_KEYS and value:
            self._arguments.append(value)
        elif key == "name" and self.name is None and not self._arguments_seen:
            self.name = self._name_so_far(end)

    def _name_so_far(self, end: int) -> str | None:
        """The name, if the object up to `end` (just past the name's string) is valid JSON."""
        try:
            name = json.loads(self.text[:end] + "}").get("name")
        except ValueError:
            return None
        return name if isinstance(name, str) and name else None

    def _close(self, end: int) -> None:
        """Stops reading at `end`; a call whose name came after its arguments is read whole."""
        self.closed = True
        self._chunks[:] = [self.text[:end]]
        if self.name is None:
            try:
                value = json.loads(self.text)
                arguments = json.loads("".join(self._arguments)) if self._arguments_seen else {}
            except ValueError:
                return
            name = value.get("name")
            if isinstance(name, str) and name and isinstance(arguments, dict):
                self.name = name
        self.end()
