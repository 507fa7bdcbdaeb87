"""The random models' byte tokenizer serves every route a real one does: log-probabilities name
each token by its text, as the engine's output text does."""

from __future__ import annotations

from zipage_jax.models.random_model import ByteTokenizer
from zipage_jax.server.response_builders import CompletionBuilder


def test_a_token_of_a_random_model_has_the_text_its_output_shows():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 105]) == "<104><105>"
    assert CompletionBuilder("m", tokenizer, "r").token_text(104) == "<104>"
