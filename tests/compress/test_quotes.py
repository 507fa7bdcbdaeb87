"""The quote pointer: how far an answer has reproduced its prompt verbatim."""

from zipage_jax.compress.quotes import advance_quote_end

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 20, 21]


def test_moves_past_the_first_match_at_or_after_the_pointer():
    assert advance_quote_end(PROMPT, [99, 11, 12, 13, 14], 0) == 5  # the answer's tail is prompt[1:5]
    # [10, 11, 12, 13] occurs twice: the first occurrence ending at or after the pointer wins
    assert advance_quote_end(PROMPT, [10, 11, 12, 13], 0) == 4
    assert advance_quote_end(PROMPT, [10, 11, 12, 13], 5) == 12


def test_never_moves_back_and_stays_without_a_match():
    assert advance_quote_end(PROMPT, [10, 11, 12, 13], 13) == 13  # both occurrences end before 13
    assert advance_quote_end(PROMPT, [11, 12, 13, 15], 3) == 3  # not a stretch of the prompt
    assert advance_quote_end(PROMPT, [12, 13, 14], 2) == 2  # shorter than the n-gram
    assert advance_quote_end(PROMPT[:3], [10, 11, 12, 13], 1) == 1  # prompt shorter than the n-gram


def test_ngram_length_is_a_parameter():
    assert advance_quote_end(PROMPT, [7, 20, 21], 0, n=2) == 14
    assert advance_quote_end(PROMPT, [7, 20, 21], 0, n=3) == 0
