"""Delivery: a request that runs again after its replica was lost shows the server nothing twice,
and a run that departs from what was delivered is refused."""

from __future__ import annotations

import pytest

from zipage_jax.data_parallel.delivery import Delivery, Diverged
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

TOKENS = [11, 12, 13, 14, 15, 16]
TEXTS = ["a", "b", "", "cd", "e", "f"]  # token 13's text is held back (released with 14's)


def out(start: int, stop: int, index: int = 0, finished: bool = False, logprobs: bool = False) -> RequestOutput:
    """The output of a run that produced tokens start..stop-1 of completion `index` in one step."""
    o = CompletionOutput(index, "".join(TEXTS) if finished else "", TOKENS if finished else [],
                         "length" if finished else None, delta_text="".join(TEXTS[start:stop]),
                         delta_token_ids=TOKENS[start:stop],
                         delta_logprobs=[TokenLogprob(t, -0.5, []) for t in TOKENS[start:stop]] if logprobs else None)
    return RequestOutput("r", None, [1, 2], [o], finished)


def deltas(output: RequestOutput | None) -> tuple[list[int], str] | None:
    return None if output is None else (output.outputs[0].delta_token_ids, output.outputs[0].delta_text)


def test_a_first_run_passes_through_unchanged():
    delivery = Delivery()
    assert not delivery.started
    first = out(0, 2)
    assert delivery.admit(first) is first
    assert delivery.started


def test_a_rerun_holds_back_what_was_delivered_and_goes_on_from_there():
    delivery = Delivery()
    delivery.admit(out(0, 2))
    delivery.admit(out(2, 4))  # delivered: 11 12 13 14, "abcd"
    delivery.restart()
    assert delivery.admit(out(0, 1)) is None
    assert delivery.admit(out(1, 3)) is None  # 12, 13: still behind
    assert deltas(delivery.admit(out(3, 5))) == ([15], "e")  # 14 again, then 15 is new
    final = delivery.admit(out(5, 6, finished=True))
    assert deltas(final) == ([16], "f") and final.finished and final.outputs[0].text == "abcdef"


def test_the_logprobs_shown_are_those_of_the_new_tokens():
    delivery = Delivery()
    delivery.admit(out(0, 3, logprobs=True))
    delivery.restart()
    shown = delivery.admit(out(0, 5, logprobs=True))
    assert deltas(shown) == ([14, 15], "cde")
    assert [lp.token_id for lp in shown.outputs[0].delta_logprobs] == [14, 15]


def test_a_second_loss_during_a_rerun_holds_back_everything_delivered_so_far():
    delivery = Delivery()
    delivery.admit(out(0, 2))
    delivery.restart()
    delivery.admit(out(0, 4))  # delivers 13, 14
    delivery.restart()
    assert delivery.admit(out(0, 4)) is None
    assert deltas(delivery.admit(out(4, 5))) == ([15], "e")


def test_a_rerun_with_other_tokens_or_text_or_an_earlier_end_diverges():
    delivery = Delivery()
    delivery.admit(out(0, 3))
    delivery.restart()
    other = out(0, 2)
    other.outputs[0].delta_token_ids = [11, 99]
    with pytest.raises(Diverged, match="departs from the tokens delivered"):
        delivery.admit(other)
    delivery.restart()
    other_text = out(0, 2)
    other_text.outputs[0].delta_text = "ax"
    with pytest.raises(Diverged):
        delivery.admit(other_text)
    delivery.restart()
    with pytest.raises(Diverged, match="ended before"):
        delivery.admit(out(0, 2, finished=True))


def test_completions_are_followed_apart_and_an_empty_step_shows_nothing():
    delivery = Delivery()
    two = RequestOutput("r", None, [1], [out(0, 2).outputs[0], out(0, 1, index=1).outputs[0]], False)
    delivery.admit(two)
    delivery.restart()
    again = RequestOutput("r", None, [1], [out(0, 2).outputs[0], out(0, 2, index=1).outputs[0]], False)
    shown = delivery.admit(again)
    assert [o.delta_token_ids for o in shown.outputs] == [[], [12]]
    assert delivery.admit(RequestOutput("r", None, [1], [out(2, 2).outputs[0], out(2, 2, index=1).outputs[0]],
                                        False)) is None
