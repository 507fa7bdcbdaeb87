"""Structured outputs on the host: llguidance compiles a request's grammar at admission, one
matcher per sequence follows its tokens, and a step's constrained rows get their next-token masks.

A mask has one bit per token of the sampler's padded vocabulary (`layers.sampler.mask_words`:
[Vp / 32] int32 words, token t = bit t % 32 of word t // 32); ids the tokenizer has no token for,
or the model no logit for, are never allowed, and EOS is allowed only where the grammar accepts
the output. The llguidance tokenizer is built once per engine, on its first constrained request.
Host work per step is one parallel llguidance call over the constrained rows and, per sampled
token, one matcher step: nothing runs over the vocabulary in Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from zipage_jax.layers.sampler import mask_words, padded_vocab
from zipage_jax.sampling_params import StructuredOutputsParams

logger = logging.getLogger("zipage_jax")

# JSON as json.dumps writes it: one space after ":" and ",", no other whitespace (free whitespace
# lets a model pad the output with blanks until max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class TokenRejected(RuntimeError):
    """A sampled token the sequence's grammar does not allow (the mask should have banned it)."""


class GrammarCompiler:
    """One engine's grammar compiler: its tokenizer as llguidance sees it, and the mask layout."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        """tokenizer: a Hugging Face fast tokenizer; vocab_size: the model's (its logits' width)."""
        self.hf_tokenizer, self.eos_token_ids = tokenizer, list(eos_token_ids)
        self.words = mask_words(vocab_size)  # of the device's mask rows
        # llguidance's vocabulary covers the padded one (its masks are cut to `words`)
        self.num_tokens = max(padded_vocab(vocab_size), len(tokenizer))
        sampleable = np.zeros(self.words * 32, bool)
        sampleable[:min(vocab_size, len(tokenizer))] = True
        self.sampleable = np.packbits(sampleable, bitorder="little").view(np.int32)  # [words]
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, spec: StructuredOutputsParams, n: int) -> list[SequenceGrammar]:
        """n matchers of the grammar `spec` describes, at its start; ValueError with llguidance's
        message for a schema, regex or grammar it cannot compile."""
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        matchers = [matcher] + [matcher.deep_copy() for _ in range(n - 1)]
        return [SequenceGrammar(m, self) for m in matchers]

    def fill(self, allowed: np.ndarray, rows: list[tuple[int, SequenceGrammar]]) -> None:
        """Writes each (row, grammar)'s next-token mask into allowed [B, words] (one parallel call)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        masks = llguidance.numpy.allocate_token_bitmask(len(rows), self.num_tokens)  # [R, >= words]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(g.matcher, j) for j, (_, g) in enumerate(rows)], masks)
        allowed[[i for i, _ in rows]] = masks[:, :self.words] & self.sampleable

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            start = time.perf_counter()
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.num_tokens, eos_token=self.eos_token_ids or None)
            except Exception as exc:  # noqa: BLE001 - whatever llguidance says, the request is refused
                raise ValueError(f"structured_outputs are not available with this tokenizer: {exc}") from None
            logger.info("structured outputs: llguidance tokenizer built in %.1f s", time.perf_counter() - start)
        return self._ll_tokenizer


class SequenceGrammar:
    """One sequence's matcher: advanced by each of its tokens, in order."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler):
        self.matcher, self.compiler = matcher, compiler

    def accept(self, token_id: int) -> bool:
        """Consumes the sequence's next token; True when the grammar is complete (the sequence
        ends here). TokenRejected if the grammar does not allow it."""
        if not self.matcher.consume_token(token_id):
            reason = self.matcher.get_error().splitlines()[0]
            raise TokenRejected(f"token {token_id} does not fit the request's grammar: {reason}")
        return self.matcher.is_stopped()


def fill_masks(allowed: np.ndarray, rows: list[tuple[int, SequenceGrammar]]) -> None:
    """The next-token masks of a step's constrained rows (all of one engine) into allowed [B, words]."""
    if rows:
        rows[0][1].compiler.fill(allowed, rows)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec` (not checked yet: the matcher reports its errors)."""
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", list(spec.choice))
    if spec.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    schema = {"type": "object"} if spec.json_object else spec.json
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (TypeError, ValueError) as exc:  # a dict that is not JSON, or text that is not an object
        raise ValueError(f"structured_outputs.json is not a JSON schema: {exc}") from None
