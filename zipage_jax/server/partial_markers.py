"""Text that may be the start of a marker (a tag such as "<tool_call>" or "</think>"): an
output parser streaming text holds it back until the next text shows whether the marker follows."""

from __future__ import annotations


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0

