"""The output stage: the core's token ids and finishes become RequestOutputs. Text streamed or
decoded only at the end is the same (and the tokenizer's full decode); a stop string ends its
sequence here and tells the core; a finished sequence's later tokens never show."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import build_tokenizer

from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.output_processor import OutputProcessor
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.sampling_params import SamplingParams

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(320)


def step(tokens: dict[int, int], finished: list[FinishedSequence] = ()) -> EngineCoreOutputs:
    """One step's core outputs: seq id -> token, then the finishes."""
    out = EngineCoreOutputs(seq_ids=np.array(list(tokens), np.int64),
                            token_ids=np.array(list(tokens.values()), np.int32))
    out.finished = list(finished)
    return out


def end(seq_id: int, reason: str = "length", stop_token: bool = False, stop_reason=None) -> FinishedSequence:
    return FinishedSequence(seq_id, reason, stop_reason, stop_token, SequenceMetrics(num_compressions=3))


def run(processor: OutputProcessor, seq_id: int, ids: list[int], last: FinishedSequence):
    """Feeds `ids` to sequence `seq_id` one step each, the last one finishing it; the outputs."""
    outputs = []
    for i, token in enumerate(ids):
        outs, _ = processor.process(step({seq_id: token}, [last] if i == len(ids) - 1 else []))
        outputs += outs
    return outputs


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_and_final_only_text_are_the_same(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(3, 320) for _ in range(60)]
    prompt = text_ids(tok, "the prompt")
    texts = {}
    for stream in (True, False):
        processor = OutputProcessor(tok)
        processor.add_request("r", None, prompt, SamplingParams(max_tokens=60), [1], stream=stream)
        outputs = run(processor, 1, ids, end(1))
        final = outputs[-1].outputs[0]
        assert outputs[-1].finished and final.token_ids == ids and final.finish_reason == "length"
        if stream:
            assert len(outputs) == 60 and "".join(o.outputs[0].delta_text for o in outputs) == final.text
        else:  # its first token (it has started) and its end
            assert len(outputs) == 2 and outputs[0].outputs[0].delta_token_ids == ids[:1]
        assert final.metrics["num_compressions"] == 3 and final.metrics["completion_tokens"] == 60
        texts[stream] = final.text
    # several steps' tokens at once (the output stage fell behind): the same text again
    processor = OutputProcessor(tok)
    processor.add_request("r", None, prompt, SamplingParams(max_tokens=60), [1], stream=True)
    streamed = ""
    for at in range(0, 60, 7):
        part = ids[at:at + 7]
        out = EngineCoreOutputs(seq_ids=np.ones(len(part), np.int64), token_ids=np.array(part, np.int32))
        out.finished = [end(1)] if at + 7 >= 60 else []
        outs, _ = processor.process(out)
        streamed += "".join(o.outputs[0].delta_text for o in outs)
    assert texts[True] == texts[False] == streamed == tok.decode(ids)


def test_a_stop_string_ends_the_sequence_here_and_later_tokens_never_show(tok):
    processor = OutputProcessor(tok)
    params = SamplingParams(max_tokens=50, stop=["brown"])
    processor.add_request("r", None, [5], params, [7, 8], stream=True)  # n = 2: one stops, one goes on
    ids = text_ids(tok, "the quick brown fox jumps")
    stopped_at = None
    for i, token in enumerate(ids):
        outs, stopped = processor.process(step({7: token, 8: token}))
        if stopped:
            assert stopped == [7, 8] and stopped_at is None  # both saw the same text
            stopped_at = i
            final = outs[0]
    assert stopped_at is not None and final.finished
    for o in final.outputs:
        assert o.text == "the quick " and o.finish_reason == "stop" and o.stop_reason == "brown"
        assert o.token_ids == ids[:stopped_at + 1]
    outs, stopped = processor.process(step({7: ids[0]}, [end(7)]))  # the core computed past the stop
    assert outs == [] and stopped == []


def test_a_stop_string_is_held_back_until_it_is_resolved(tok):
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [5], SamplingParams(max_tokens=50, stop=["abc"]), [1])
    streamed = ""
    for token in text_ids(tok, "xx ab x ab"):
        outs, _ = processor.process(step({1: token}))
        streamed += "".join(o.outputs[0].delta_text for o in outs)
        assert not streamed.endswith(("a", "ab"))  # a possible start of the stop string waits
    outs, _ = processor.process(step({1: text_ids(tok, "z")[0]}, [end(1)]))
    streamed += outs[0].outputs[0].delta_text
    assert streamed == outs[0].outputs[0].text == "xx ab x abz"


@pytest.mark.parametrize("include", [False, True])
def test_the_core_s_stop_token_text_shows_only_when_asked(tok, include):
    ids = text_ids(tok, "hello there") + [EOS]
    for stream in (True, False):
        processor = OutputProcessor(tok)
        params = SamplingParams(max_tokens=50, include_stop_str_in_output=include, skip_special_tokens=False)
        processor.add_request("r", None, [5], params, [1], stream=stream)
        final = run(processor, 1, ids, end(1, "stop", stop_token=True))[-1].outputs[0]
        assert final.text == "hello there" + ("<|im_end|>" if include else "")
        assert final.token_ids == ids and final.finish_reason == "stop" and final.stop_reason is None


def test_stop_strings_wait_for_min_tokens(tok):
    processor = OutputProcessor(tok)
    ids = text_ids(tok, "a b a b a b")
    processor.add_request("r", None, [5], SamplingParams(max_tokens=50, min_tokens=4, stop=["b"]), [1],
                          stream=False)
    at = None
    for i, token in enumerate(ids):
        outs, stopped = processor.process(step({1: token}))
        if stopped:
            at = i
            break
    assert at is not None and at >= 4  # its 5th token at the earliest
    text = tok.decode(ids[:at + 1])
    final = outs[-1].outputs[0].text
    assert final == text[:text.rindex("b")] and "b" in final  # the earlier "b"s did not stop it


def test_logprobs_and_failures(tok):
    processor = OutputProcessor(tok)
    processor.add_request("a", "prompt text", [5], SamplingParams(max_tokens=5, logprobs=2), [1])
    processor.add_request("b", None, [5], SamplingParams(max_tokens=5), [2])
    out = step({1: 40, 2: 41})
    out.logprobs = np.array([-0.25, -0.5], np.float32)
    out.top_ids = np.array([[40, 41, 42], [41, 40, 42]], np.int32)
    out.top_logprobs = np.array([[-0.25, -2.0, -3.0], [-0.5, -1.0, -3.0]], np.float32)
    outs, _ = processor.process(out)
    a = next(o for o in outs if o.request_id == "a")
    lp = a.outputs[0].delta_logprobs[0]
    assert a.prompt == "prompt text" and (lp.token_id, lp.logprob, lp.top) == (40, -0.25, [(40, -0.25), (41, -2.0)])
    failed = EngineCoreOutputs(failures=[("b", "RuntimeError: boom", None)], finished=[end(2, "error")])
    outs, _ = processor.process(failed)
    assert [(o.request_id, o.error, o.finished, o.outputs[0].finish_reason) for o in outs] == [
        ("b", "RuntimeError: boom", True, "error")]
    assert set(processor.requests) == {"a"}
