"""How far an answer has quoted its prompt: host-side, from token ids alone.

Instruct models often restate the prompt before answering (a function's signature and
docstring, the question): an induction head then reads the prompt token that follows the
current one, so the prompt's part not yet quoted is what the answer needs next, and the part
already quoted lives on in the answer itself. `quote_end` is the prompt position just after
the last stretch the answer reproduced verbatim; the prompt reserve ranks the prompt's tokens
from there on first (docs/ALGORITHM.md section 5).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

QUOTE_NGRAM = 4  # answer tokens that must match the prompt verbatim to count as quoting it


def advance_quote_end(prompt: Sequence[int], answer: Sequence[int], quote_end: int, n: int = QUOTE_NGRAM) -> int:
    """The new quote end: just after the first occurrence in the prompt of the answer's last `n`
    tokens that ends at or after `quote_end`; `quote_end` itself (it never moves back) when the
    answer's tail is not a stretch of the prompt there."""
    if len(answer) < n or len(prompt) < n:
        return quote_end
    return find_quote_end(as_bytes(prompt), as_bytes(answer[-n:]), quote_end)


def find_quote_end(prompt: bytes, tail: bytes, quote_end: int) -> int:
    """`advance_quote_end` of a prompt and the answer's last n tokens given as `as_bytes`."""
    # a byte search over the ids as int64 (a match must start at a whole id): no Python per token
    n = len(tail) // 8
    at = max(0, quote_end - n) * 8  # a match that ends at or after quote_end starts here or later
    while (at := prompt.find(tail, at)) >= 0:
        if at % 8 == 0:
            return at // 8 + n
        at += 1
    return quote_end


def as_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the quote search reads them (int64 bytes)."""
    return np.asarray(token_ids, np.int64).tobytes()
