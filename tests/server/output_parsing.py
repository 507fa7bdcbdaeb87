"""What the output-parser tests share: every split of a text to stream it in, and a grammar
checked token by token with the engine's matcher on the tiny tokenizer."""

from __future__ import annotations

import random

import numpy as np
from tiny_models import build_tokenizer

from zipage_jax.engine.grammar import GrammarCompiler, TokenRejected
from zipage_jax.sampling_params import StructuredOutputsParams
from zipage_jax.server.structured import JSON_LAYOUT

EOS = 2  # the tiny tokenizer's <|im_end|>
# get_weather's parameters, strict in call_schema
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}


def splits(text: str) -> list[list[str]]:
    """Every two-piece split and the one-character pieces."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def tiny_grammar_compiler() -> GrammarCompiler:
    return GrammarCompiler(build_tokenizer(320), vocab_size=320, eos_token_ids=[EOS])


def accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Whether the Lark grammar lets the model write `text` and then end (EOS)."""
    (matcher,) = compiler.compile(StructuredOutputsParams(grammar=grammar), 1)
    try:
        for token in compiler.hf_tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS]:
            matcher.accept(token)
    except TokenRejected:
        return False
    return True


def call_schema(key: str) -> dict:
    """Calls of get_weather (strict: WEATHER_PARAMS) and get_time (any object), their arguments
    under `key`, as structured.py builds them."""
    return {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, key: WEATHER_PARAMS},
         "required": ["name", key], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "get_time"}, key: {"type": "object"}},
         "required": ["name", key], "additionalProperties": False}], "x-guidance": JSON_LAYOUT}


def random_output(compiler: GrammarCompiler, grammar: str, prefix: str, rng: random.Random, stop: str,
                  max_tokens: int = 200) -> str | None:
    """A "model" that writes `prefix`, then tokens drawn at random among those the grammar
    allows, until its text holds `stop` (None if it does not within max_tokens)."""
    (matcher,) = compiler.compile(StructuredOutputsParams(grammar=grammar), 1)
    tokens = compiler.hf_tokenizer(prefix, add_special_tokens=False)["input_ids"]
    for token in tokens:
        matcher.accept(token)
    allowed = np.zeros((1, compiler.words), np.int32)
    for _ in range(max_tokens):
        compiler.fill(allowed, [(0, matcher)])
        choices = np.flatnonzero(np.unpackbits(allowed.view(np.uint8), bitorder="little"))
        token = rng.choice([int(t) for t in choices if t != EOS] or [EOS])
        matcher.accept(token)
        tokens.append(token)
        text = compiler.hf_tokenizer.decode(tokens)
        if stop in text:
            return text
    return None
