"""Per output sequence, in the output stage: incremental detokenisation and stop strings.

Detokenisation follows vLLM: each step decodes only a short window of tokens, from
`prefix_offset` (a few tokens of context, so a leading space or a byte-level merge comes out
as in a full decode) to the end, and emits the part past `read_offset`; text that ends in an
unfinished UTF-8 character ("\\ufffd") waits for the next token.

Stops (vLLM semantics): the engine core finishes a sequence by token (EOS unless ignore_eos,
stop_token_ids, max_tokens, the length limit, a complete grammar) and says so with the token
(`append(..., ends=True)`); the text of EOS or a stop token id is dropped unless
include_stop_str_in_output. Past the first `min_tokens` tokens, a stop string found in the text
finishes the sequence here ("stop"), the text cut before the string (after it with
include_stop_str_in_output); a stop string wins over the engine's reason on the same token.
Any tail of the text that could still become a stop string is held back (from the deltas
and from `.text`) until it is resolved, so streamed text never has to be taken back:
`.text` is always the concatenation of the deltas returned so far.

Work per token is constant in the output length: the tokenizer's special ids are read once per
engine, and only a window of the text past what was emitted is kept as one string (a stop
string can only start at or after the emitted text); the rest is kept as emitted pieces. The
held-back tail is tracked per stop string as text arrives (`StopPrefix`), so a long stop
string costs its new characters per token, not its length squared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zipage_jax.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM's offset)


_KEEP_CHARS = 4096  # emitted text kept in the working string before it moves to the emitted pieces


class StopChecker:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int],
                 special_ids: Iterable[int] | None = None):
        """special_ids: the tokenizer's special token ids (read from it when not given)."""
        self.tokenizer = tokenizer
        self.params = params
        skipped = frozenset(special_ids if special_ids is not None else tokenizer.all_special_ids)
        self._skipped = skipped if params.skip_special_tokens else frozenset()
        self.num_tokens = 0  # output tokens, stop tokens included
        self._pieces: list[str] = []  # emitted text before _text
        self._text = ""  # the rest of the decoded output, held-back tail included; cut at a stop string
        self.done = False  # the sequence ended (the engine's reason, or `stop_string`)
        self.stop_string: str | None = None  # the stop string that ended it
        self._tokens = self._to_tokens(prompt_token_ids[-_CONTEXT_TOKENS - 2:])  # tokenizer pieces
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._emitted = 0  # characters of .text already returned as deltas
        held = () if params.include_stop_str_in_output else params.stop
        self._prefixes = [StopPrefix(stop) for stop in dict.fromkeys(held)]

    def append(self, token_id: int, ends: bool = False, stop_token: bool = False) -> tuple[str, bool]:
        """Adds one output token; returns (new text safe to stream, whether a stop string ended the
        sequence at it). ends: the engine finished the sequence at this token (its text is flushed);
        stop_token: it is EOS or a stop token id (its text is dropped unless include_stop_str_in_output)."""
        if self.done:
            raise RuntimeError(f"sequence already finished; cannot append token {token_id}")
        params = self.params
        self.num_tokens += 1
        may_stop = self.num_tokens > params.min_tokens
        if not stop_token or params.include_stop_str_in_output:
            self._tokens.extend(self._to_tokens([token_id]))
        checked = len(self._text)
        added = self._decode(flush=ends)
        self._text += added
        for prefix in self._prefixes:
            prefix.feed(added)
        matched = may_stop and self._match_stop_string(checked)
        self.done = ends or matched
        end = len(self._text) if self.done else len(self._text) - self._held_back()
        delta, self._emitted = self._text[self._emitted:end], max(end, self._emitted)
        if self._emitted > 2 * _KEEP_CHARS:  # move emitted text out of the working string
            self._pieces.append(self._text[:_KEEP_CHARS])
            self._text, self._emitted = self._text[_KEEP_CHARS:], self._emitted - _KEEP_CHARS
        return delta, matched

    def extend(self, token_ids: Sequence[int], ends: bool = False, stop_token: bool = False) -> str:
        """`append` of several tokens at once, decoded together: for a sequence without stop strings
        (nothing to find between them). stop_token: the last one is EOS or a stop token id."""
        if self.done:
            raise RuntimeError("sequence already finished; cannot extend it")
        if self._prefixes or self.params.stop:
            raise RuntimeError("a sequence with stop strings takes its tokens one by one (append)")
        self.num_tokens += len(token_ids)
        keep = token_ids if not stop_token or self.params.include_stop_str_in_output else token_ids[:-1]
        self._tokens.extend(self._to_tokens(keep))
        self._text += self._decode(flush=ends)
        self.done = ends
        delta, self._emitted = self._text[self._emitted:], len(self._text)
        if self._emitted > 2 * _KEEP_CHARS:
            self._pieces.append(self._text[:_KEEP_CHARS])
            self._text, self._emitted = self._text[_KEEP_CHARS:], self._emitted - _KEEP_CHARS
        return delta

    @property
    def text(self) -> str:
        """The output text streamed so far; the whole output once finished (O(length): read it once)."""
        return "".join(self._pieces) + self._text[: self._emitted]

    def _to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens([int(i) for i in ids if int(i) not in self._skipped])

    def _decode(self, flush: bool) -> str:
        # the new text of the pieces past read_offset; flush: even if it ends in a partial character
        window = self._tokens[self._prefix_offset:]
        prefix = self.tokenizer.convert_tokens_to_string(window[: self._read_offset - self._prefix_offset])
        text = self.tokenizer.convert_tokens_to_string(window)
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not flush):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return text[len(prefix):]

    def _match_stop_string(self, checked: int) -> bool:
        # only matches that end in the text added since `checked` are new
        best = None
        for stop in self.params.stop:
            at = self._text.find(stop, max(checked - len(stop) + 1, 0))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self._text = self._text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        self.stop_string = stop
        return True

    def _held_back(self) -> int:
        # the longest tail of the text that begins a stop string and may still complete it
        return max((prefix.held for prefix in self._prefixes), default=0)


class StopPrefix:
    """The longest proper prefix of `stop` that the text fed so far ends with (Knuth-Morris-Pratt:
    amortised constant work per character fed)."""

    def __init__(self, stop: str):
        self.stop = stop
        self._border = _borders(stop)
        self._matched = 0  # the longest prefix of stop the text ends with (len(stop): a whole match)

    def feed(self, text: str) -> None:
        stop, border, k = self.stop, self._border, self._matched
        for ch in text:
            if k == len(stop):
                k = border[k - 1]
            while k and stop[k] != ch:
                k = border[k - 1]
            if stop[k] == ch:
                k += 1
        self._matched = k

    @property
    def held(self) -> int:
        return self._matched if self._matched < len(self.stop) else self._border[-1]


def _borders(s: str) -> list[int]:
    """border[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    border, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border
