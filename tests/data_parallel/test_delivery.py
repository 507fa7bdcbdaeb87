"""Delivery: a request that runs again after its replica was lost hands on no token twice, and a
run that departs from what was handed on (other tokens, an earlier end) is refused."""

from __future__ import annotations

import pytest

from zipage_jax.data_parallel.delivery import Delivery, Diverged

TOKENS = [11, 12, 13, 14, 15, 16]


def test_a_first_run_holds_back_nothing():
    delivery = Delivery(1)
    assert not delivery.started
    assert delivery.hand_on(0, TOKENS[:2]) == 0
    assert delivery.started
    assert delivery.hand_on(0, TOKENS[2:3]) == 0
    delivery.finish(0)


def test_a_rerun_holds_back_what_was_handed_on_and_goes_on_from_there():
    delivery = Delivery(1)
    delivery.hand_on(0, TOKENS[:2])
    delivery.hand_on(0, TOKENS[2:4])  # handed on: 11 12 13 14
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:1]) == 1
    assert delivery.hand_on(0, TOKENS[1:3]) == 2  # 12, 13: still behind
    assert delivery.hand_on(0, TOKENS[3:5]) == 1  # 14 again, then 15 is new
    assert delivery.hand_on(0, TOKENS[5:]) == 0
    delivery.finish(0)


def test_a_second_loss_during_a_rerun_holds_back_everything_handed_on_so_far():
    delivery = Delivery(1)
    delivery.hand_on(0, TOKENS[:2])
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:4]) == 2  # hands on 13, 14
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:4]) == 4
    assert delivery.hand_on(0, TOKENS[4:5]) == 0


def test_a_rerun_with_other_tokens_or_an_earlier_end_diverges():
    delivery = Delivery(1)
    delivery.hand_on(0, TOKENS[:3])
    delivery.restart()
    with pytest.raises(Diverged, match="departs from the tokens delivered"):
        delivery.hand_on(0, [11, 99])
    delivery.restart()
    with pytest.raises(Diverged, match="departs from the tokens delivered"):
        delivery.hand_on(0, [99])  # its first token already differs
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:2]) == 2
    with pytest.raises(Diverged, match="ended before"):
        delivery.finish(0)
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:3]) == 3
    delivery.finish(0)  # caught up: it may end here


def test_a_rerun_may_go_past_what_was_handed_on_in_one_step():
    delivery = Delivery(1)
    delivery.hand_on(0, TOKENS[:2])
    delivery.restart()
    with pytest.raises(Diverged):
        delivery.hand_on(0, [11, 77, 13])  # a departure inside the part held back
    delivery.restart()
    assert delivery.hand_on(0, TOKENS) == 2  # the rest is new


def test_completions_are_followed_apart():
    delivery = Delivery(2)
    delivery.hand_on(0, TOKENS[:2])
    delivery.hand_on(1, TOKENS[:1])
    delivery.restart()
    assert delivery.hand_on(0, TOKENS[:2]) == 2
    assert delivery.hand_on(1, TOKENS[:2]) == 1  # 12 is new for completion 1
    assert delivery.hand_on(1, []) == 0
    delivery.finish(0)
    delivery.finish(1)


def test_the_prompts_logprobs_are_held_back_by_position():
    delivery = Delivery(1)
    assert delivery.hand_on_prompt_logprobs(1, 4) == 0  # positions 1..4 handed on
    delivery.restart()
    assert delivery.hand_on_prompt_logprobs(1, 2) == 2
    assert delivery.hand_on_prompt_logprobs(3, 4) == 2  # 3, 4 again; 5, 6 are new
    assert delivery.hand_on_prompt_logprobs(7, 1) == 0
