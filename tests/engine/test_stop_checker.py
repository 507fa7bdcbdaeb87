"""StopChecker with the default model's tokenizer (SmolLM2 byte-level BPE, from its GGUF)."""

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


def _feed(tok, sp: SP, ids: list[int], eos: int, prompt: list[int] | None = None):
    """Appends ids until the checker finishes; returns (checker, deltas, tokens consumed)."""
    checker = StopChecker(tok, sp, [eos], prompt if prompt is not None else tok.encode("Say it:"))
    deltas = []
    for n, token_id in enumerate(ids, 1):
        delta, reason = checker.append(token_id)
        deltas.append(delta)
        assert reason == checker.finish_reason and checker.text == "".join(deltas)
        if reason is not None:
            return checker, deltas, n
    return checker, deltas, len(ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", [[], None])
def test_incremental_text_equals_full_decode(tok, eos, text, prompt):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids) or "def" in text  # some characters span tokens
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids)), ids, eos, prompt)
    assert checker.text == text == "".join(deltas)
    assert checker.finish_reason == "length" and checker.stop_reason is None
    assert not any("\ufffd" in d for d in deltas)
    assert checker.num_tokens == len(ids)


def test_long_output_keeps_its_text_and_finds_a_late_stop_string(tok, eos):
    # longer than the working string the checker keeps: emitted text moves to pieces, nothing is lost
    text = "".join(TEXTS) * 120 + " the end ZZSTOP tail"
    ids = tok.encode(text)
    checker, deltas, n = _feed(tok, SP(max_tokens=len(ids), stop="ZZSTOP"), ids, eos)
    assert checker.text == text[: text.index("ZZSTOP")]
    assert checker.finish_reason == "stop" and checker.stop_reason == "ZZSTOP"
    assert len(checker._text) < 3 * 4096 + 100  # the working string stayed bounded


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, eos, skip):
    ids = tok.encode("a b") + [1] + tok.encode("user\nhi") + [eos] + tok.encode(" x")
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip), ids, eos)
    assert checker.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in checker.text) == (not skip)


def test_each_step_decodes_a_short_window(tok, eos):
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tok, name)

        def convert_tokens_to_string(self, tokens):
            calls.append(len(tokens))
            return tok.convert_tokens_to_string(tokens)

    ids = tok.encode(" ".join(TEXTS) * 8)
    checker = StopChecker(Recording(), SP(max_tokens=len(ids)), [eos], tok.encode("a long prompt " * 50))
    for token_id in ids:
        checker.append(token_id)
    assert checker.text == tok.decode(ids) and len(ids) > 200
    assert max(calls) <= 12 and len(calls) == 2 * len(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok, eos):
    text = "The answer is 42. STOP and more"
    ids = tok.encode(text)
    assert [tok.decode([i]) for i in ids][7:9] == [" ST", "OP"]
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop=["42. STOP"]), ids, eos)
    assert (checker.finish_reason, checker.stop_reason) == ("stop", "42. STOP")
    assert n == 9  # finished on the token that completed the stop string
    assert checker.text == "".join(deltas) == "The answer is "
    assert checker.num_tokens == len(ids[:9])


def test_include_stop_str_in_output(tok, eos):
    ids = tok.encode("The answer is 42. STOP and more")
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop="swer", include_stop_str_in_output=True), ids, eos)
    assert checker.text == "".join(deltas) == "The answer" and n == 2 and checker.stop_reason == "swer"
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop="swer"), ids, eos)
    assert checker.text == "".join(deltas) == "The an" and n == 2  # cut inside a token


def test_earliest_stop_string_wins(tok, eos):
    ids = tok.encode("The answer is 42.")
    checker, _, n = _feed(tok, SP(max_tokens=50, stop=["wer", "ans"]), ids, eos)
    assert (checker.stop_reason, checker.text, n) == ("ans", "The ", 2)


def test_partial_match_is_held_back_then_released(tok, eos):
    ids = tok.encode("The answer is 42. STOP and more")
    checker = StopChecker(tok, SP(max_tokens=50, stop="STOPPED"), [eos], [])
    streamed = ""
    for i, token_id in enumerate(ids):
        delta, reason = checker.append(token_id)
        streamed += delta
        if i == 8:  # " ST" "OP": "STOP" could still become "STOPPED"
            assert streamed == checker.text == "The answer is 42. "
        assert reason is None
    assert streamed == checker.text == "The answer is 42. STOP and more"
    checker, deltas, n = _feed(tok, SP(max_tokens=9, stop="STOPPED"), ids, eos)
    assert n == 9 and checker.finish_reason == "length"
    assert deltas[-1] == "STOP" and "".join(deltas) == checker.text  # flushed when the sequence ends


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids(tok, eos, include):
    ids = tok.encode("The answer is 42.")
    stop_id = ids[2]  # " is"
    checker, deltas, n = _feed(tok, SP(max_tokens=50, stop_token_ids=[stop_id], include_stop_str_in_output=include),
                               ids, eos)
    assert (checker.finish_reason, checker.stop_reason, n) == ("stop", stop_id, 3)
    assert checker.text == "".join(deltas) == ("The answer is" if include else "The answer")
    assert checker.num_tokens == len(ids[:3])


def test_eos_and_ignore_eos(tok, eos):
    ids = tok.encode("The answer") + [eos] + tok.encode(" is 42.")
    checker, deltas, n = _feed(tok, SP(max_tokens=50), ids, eos)
    assert (checker.finish_reason, checker.stop_reason, n, checker.text) == ("stop", None, 3, "The answer")
    checker, deltas, n = _feed(tok, SP(max_tokens=6, ignore_eos=True), ids, eos)
    assert (checker.finish_reason, n, checker.text) == ("length", 6, "The answer is 4")
    assert "".join(deltas) == checker.text


def test_min_tokens_defers_every_stop(tok, eos):
    ids = tok.encode("The") + [eos] + tok.encode(" answer is The end")
    sp = SP(max_tokens=50, min_tokens=3, stop="The", stop_token_ids=[ids[2]])
    checker, deltas, n = _feed(tok, sp, ids, eos)
    # "The" (token 1), EOS (token 2) and the stop id (token 3) come too early; the second "The" stops
    assert (checker.finish_reason, checker.stop_reason, n) == ("stop", "The", 5)
    assert checker.text == "".join(deltas) == "The answer is "
    checker, _, n = _feed(tok, SP(max_tokens=2, min_tokens=2, stop="The"), ids, eos)
    assert (checker.finish_reason, n) == ("length", 2)


def test_max_tokens_mid_character_flushes(tok, eos):
    ids = tok.encode("x 日本語 y")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    checker, deltas, n = _feed(tok, SP(max_tokens=cut), ids, eos)
    assert (checker.finish_reason, n) == ("length", cut)
    assert checker.text == "".join(deltas) == tok.decode(ids[:cut])


def test_a_final_token_stops_and_flushes_held_back_text(tok, eos):
    # a completed grammar ends the sequence: "stop", the tail a stop string could have claimed
    # and a character split across tokens both released
    ids = tok.encode("x 日本語 ST")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    for end in (cut, len(ids)):
        checker = StopChecker(tok, SP(max_tokens=50, stop="STOP"), [eos], [])
        deltas = [checker.append(t)[0] for t in ids[:end - 1]]
        delta, reason = checker.append(ids[end - 1], final=True)
        assert (reason, checker.stop_reason) == ("stop", None)
        assert checker.text == "".join(deltas + [delta]) == tok.decode(ids[:end])


def test_append_after_finish_raises(tok, eos):
    checker = StopChecker(tok, SP(max_tokens=1), [eos], [])
    assert checker.append(tok.encode("Hi")[0]) == ("Hi", "length")
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


def test_a_long_stop_string_is_held_back_while_it_may_still_match(tok, eos):
    stop = "The answer is 42. " * 500  # 9,000 characters
    ids = tok.encode("The answer is 42. The answer is 42. Then")
    checker, deltas, _ = _feed(tok, SP(max_tokens=len(ids) + 1, stop=stop), ids, eos)
    assert deltas[-1].endswith("Then") and "".join(deltas) == "The answer is 42. The answer is 42. Then"
    assert "".join(deltas[:-1]) == ""  # until "Then", all of it could still begin the stop string
