"""StopChecker with the default model's tokenizer (SmolLM2 byte-level BPE, from its GGUF).

The checker detokenises and matches stop strings; the engine core decides the token-based
finishes (EOS, stop_token_ids, min_tokens, max_tokens: Scheduler.update_from_output, tested
through the engine in test_engine.py) and tells the checker with the token that ends the
sequence (`ends`, `stop_token`). Here the tests play the core's part."""

import random

import pytest
from transformers import AutoTokenizer

from zipage_jax.engine.stop_checker import StopChecker, StopPrefix
from zipage_jax.models.loading import resolve_source
from zipage_jax.sampling_params import SamplingParams as SP

TEXTS = [
    "Hello wörld 日本語 🙂 and then STOP here, more text",
    "    def f(x):\n\treturn x  # ok\n\n",
    "Ünïcödé: 𝔘𝔫𝔦 — “quotes” ½ 🇫🇷🇯🇵 done",
]


@pytest.fixture(scope="module")
def tok():
    gguf = resolve_source("default")  # the embedded default model; a clear error if it is missing
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def eos(tok) -> int:
    return tok.eos_token_id


def _feed(tok, sp: SP, ids: list[int], prompt: list[int] | None = None, ends: bool = True,
          stop_token: bool = False):
    """Appends ids until the checker finishes; returns (checker, deltas, tokens consumed).
    `ends`: the core finishes the sequence at the last of `ids` (`stop_token`: that token is EOS
    or a stop token id), as it does at max_tokens, a stop token or a completed grammar."""
    checker = StopChecker(tok, sp, prompt if prompt is not None else tok.encode("Say it:"))
    deltas = []
    for n, token_id in enumerate(ids, 1):
        last = ends and n == len(ids)
        delta, matched = checker.append(token_id, ends=last, stop_token=last and stop_token)
        deltas.append(delta)
        assert matched == (checker.stop_string is not None) and checker.text == "".join(deltas)
        assert checker.done == (matched or last)
        if checker.done:
            return checker, deltas, n
    return checker, deltas, len(ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", [[], None])
def test_incremental_text_equals_full_decode(tok, text, prompt):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or "def" in text  # some characters span tokens
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids)), ids, prompt)
    assert checker.text == text == "".join(deltas)
    assert checker.done and checker.stop_string is None
    assert not any("\ufffd" in d for d in deltas)
    assert checker.num_tokens == len(ids)


def test_long_output_keeps_its_text_and_finds_a_late_stop_string(tok):
    # longer than the working string the checker keeps: emitted text moves to pieces, nothing is lost
    text = "".join(TEXTS) * 120 + " the end ZZSTOP tail"
    ids = tok.encode(text)
    checker, deltas, n = _feed(tok, SP(max_tokens=len(ids), stop="ZZSTOP"), ids)
    assert checker.text == text[: text.index("ZZSTOP")]
    assert checker.done and checker.stop_string == "ZZSTOP" and n < len(ids)
    assert len(checker._text) < 3 * 4096 + 100  # the working string stayed bounded


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, eos, skip):
    ids = tok.encode("a b") + [1] + tok.encode("user\nhi") + [eos] + tok.encode(" x")
    # with ignore_eos the core does not stop at the EOS: it is just another special token here
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip), ids)
    assert checker.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in checker.text) == (not skip)


def test_each_step_decodes_a_short_window(tok):
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tok, name)

        def convert_tokens_to_string(self, tokens):
            calls.append(len(tokens))
            return tok.convert_tokens_to_string(tokens)

    ids = tok.encode(" ".join(TEXTS) * 8)
    checker = StopChecker(Recording(), SP(max_tokens=len(ids)), tok.encode("a long prompt " * 50))
    for i, token_id in enumerate(ids):
        checker.append(token_id, ends=i == len(ids) - 1)
    assert checker.text == tok.decode(ids) and len(ids) > 200
    assert max(calls) <= 12 and len(calls) == 2 * len(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok):
    text = "The answer is 42. STOP and more"
    ids = tok.encode(text)
    assert [tok.decode([i]) for i in ids][7:9] == [" ST", "OP"]
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop=["42. STOP"]), ids, ends=False)
    assert checker.done and checker.stop_string == "42. STOP"
    assert n == 9  # finished on the token that completed the stop string
    assert checker.text == "".join(deltas) == "The answer is "
    assert checker.num_tokens == len(ids[:9])


def test_include_stop_str_in_output(tok):
    ids = tok.encode("The answer is 42. STOP and more")
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop="swer", include_stop_str_in_output=True), ids,
                               ends=False)
    assert checker.text == "".join(deltas) == "The answer" and n == 2 and checker.stop_string == "swer"
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop="swer"), ids, ends=False)
    assert checker.text == "".join(deltas) == "The an" and n == 2  # cut inside a token


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("The answer is 42.")
    checker, _, n = _feed(tok, SP(max_tokens=50, stop=["wer", "ans"]), ids, ends=False)
    assert (checker.stop_string, checker.text, n) == ("ans", "The ", 2)


def test_a_stop_string_wins_over_the_cores_finish_on_the_same_token(tok):
    ids = tok.encode("The answer is 42.")
    checker, deltas, n = _feed(tok, SP(max_tokens=2, stop="swer"), ids[:2])
    assert (checker.done, checker.stop_string, n) == (True, "swer", 2)
    assert checker.text == "".join(deltas) == "The an"


def test_partial_match_is_held_back_then_released(tok):
    ids = tok.encode("The answer is 42. STOP and more")
    checker = StopChecker(tok, SP(max_tokens=50, stop="STOPPED"), [])
    streamed = ""
    for i, token_id in enumerate(ids):
        delta, matched = checker.append(token_id)
        streamed += delta
        if i == 8:  # " ST" "OP": "STOP" could still become "STOPPED"
            assert streamed == checker.text == "The answer is 42. "
        assert not matched and not checker.done
    assert streamed == checker.text == "The answer is 42. STOP and more"
    checker, deltas, n = _feed(tok, SP(max_tokens=9, stop="STOPPED"), ids[:9])  # the core ends it at token 9
    assert n == 9 and checker.done and checker.stop_string is None
    assert deltas[-1] == "STOP" and "".join(deltas) == checker.text  # flushed when the sequence ends


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_that_ends_the_sequence_drops_its_text(tok, include):
    ids = tok.encode("The answer is 42.")
    stop_id = ids[2]  # " is": the core ended the sequence at it
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop_token_ids=[stop_id], include_stop_str_in_output=include),
                               ids[:3], stop_token=True)
    assert (checker.done, checker.stop_string, n) == (True, None, 3)
    assert checker.text == "".join(deltas) == ("The answer is" if include else "The answer")
    assert checker.num_tokens == len(ids[:3])


@pytest.mark.parametrize("include", [False, True])
def test_an_eos_that_ends_the_sequence_drops_its_text(tok, eos, include):
    ids = tok.encode("The answer") + [eos]
    sp = SP(max_tokens=50, skip_special_tokens=False, include_stop_str_in_output=include)
    checker, deltas, n = _feed(tok, sp, ids, stop_token=True)
    assert (checker.done, checker.stop_string, n) == (True, None, 3)
    assert checker.text == "".join(deltas) == "The answer" + (tok.decode([eos]) if include else "")


def test_a_token_that_does_not_end_the_sequence_keeps_its_text(tok, eos):
    # ignore_eos, or a stop id within min_tokens: the core goes on, the token is ordinary text
    ids = tok.encode("The answer") + [eos] + tok.encode(" is 42.")
    checker, deltas, n = _feed(tok, SP(max_tokens=6, ignore_eos=True, skip_special_tokens=False), ids[:6])
    assert (checker.done, n) == (True, 6)
    assert checker.text == "".join(deltas) == tok.decode(ids[:6], skip_special_tokens=False)


def test_min_tokens_defers_stop_strings(tok, eos):
    ids = tok.encode("The") + [eos] + tok.encode(" answer is The end")
    sp = SP(max_tokens=50, min_tokens=3, stop="The", stop_token_ids=[ids[2]])
    checker, deltas, n = _feed(tok, sp, ids, ends=False)
    # "The" (token 1) comes too early (the core let EOS and the stop id through for the same
    # reason); the second "The" stops
    assert (checker.done, checker.stop_string, n) == (True, "The", 5)
    assert checker.text == "".join(deltas) == "The answer is "
    checker, _, n = _feed(tok, SP(max_tokens=2, min_tokens=2, stop="The"), ids[:2])
    assert (checker.done, checker.stop_string, n) == (True, None, 2)


def test_max_tokens_mid_character_flushes(tok):
    ids = tok.encode("x 日本語 y")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    checker, deltas, n = _feed(tok, SP(max_tokens=cut), ids[:cut])
    assert (checker.done, checker.stop_string, n) == (True, None, cut)
    assert checker.text == "".join(deltas) == tok.decode(ids[:cut])
    assert checker.text.endswith("\ufffd")


def test_a_final_token_stops_and_flushes_held_back_text(tok):
    # a completed grammar ends the sequence: "stop", the tail a stop string could have claimed
    # and a character split across tokens both released
    ids = tok.encode("x 日本語 ST")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    for end in (cut, len(ids)):
        checker = StopChecker(tok, SP(max_tokens=50, stop="STOP"), [])
        deltas = [checker.append(t)[0] for t in ids[:end - 1]]
        delta, matched = checker.append(ids[end - 1], ends=True)
        assert (matched, checker.done, checker.stop_string) == (False, True, None)
        assert checker.text == "".join(deltas + [delta]) == tok.decode(ids[:end])


def test_append_after_finish_raises(tok):
    checker = StopChecker(tok, SP(max_tokens=1), [])
    assert checker.append(tok.encode("Hi")[0], ends=True) == ("Hi", False)
    with pytest.raises(RuntimeError, match="already finished"):
        checker.append(5)


def _naive_held(text: str, stop: str) -> int:
    return max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def test_stop_prefix_tracks_the_longest_held_back_tail():
    rng = random.Random(0)
    for _ in range(300):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        prefix, text = StopPrefix(stop), ""
        for _ in range(rng.randint(1, 12)):  # text arrives in pieces, as tokens decode
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            prefix.feed(piece)
            text += piece
            assert prefix.held == _naive_held(text, stop), (stop, text)


def test_a_long_stop_string_is_held_back_while_it_may_still_match(tok):
    stop = "The answer is 42. " * 500  # 9,000 characters
    ids = tok.encode("The answer is 42. The answer is 42. Then")
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids) + 1, stop=stop), ids, ends=False)
    assert deltas[-1].endswith("Then") and "".join(deltas) == "The answer is 42. The answer is 42. Then"
    assert "".join(deltas[:-1]) == ""  # until "Then", all of it could still begin the stop string
