import dataclasses

import pytest

from zipage_jax.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (sp.seed, sp.stop, sp.stop_token_ids, sp.ignore_eos) == (None, (), (), False)
    assert (sp.min_tokens, sp.max_tokens, sp.logprobs, sp.kv_budget) == (0, 16, None, None)
    assert sp.skip_special_tokens and not sp.include_stop_str_in_output
    assert not sp.greedy and SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    sp = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(sp.temperature, float) and isinstance(sp.repetition_penalty, float)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(kv_budget=0).kv_budget == 0 and SamplingParams(seed=-3).seed == -3
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5
    assert dataclasses.replace(SamplingParams(stop="x"), n=2).stop == ("x",)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 1.0}, "n must be an integer, got 1.0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": "1"}, "temperature must be a finite number, got '1'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1, got -2"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"min_p": -0.5}, r"min_p must be in \[0, 1\], got -0.5"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"repetition_penalty": -1}, "repetition_penalty must be > 0, got -1.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
        ({"frequency_penalty": True}, "frequency_penalty must be a finite number, got True"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 3]}, r"stop must be a string or a list of strings, got \['a', 3\]"),
        ({"stop": ["a", ""]}, "stop must not contain an empty string"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of non-negative integers"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of non-negative integers, got 7"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": None}, "max_tokens must be an integer, got None"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 17}, "min_tokens must be <= max_tokens=16, got 17"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
        ({"logprobs": True}, "logprobs must be an integer, got True"),
        ({"kv_budget": -1}, "kv_budget must be >= 0, got -1"),
        ({"kv_budget": 1.5}, "kv_budget must be an integer, got 1.5"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
