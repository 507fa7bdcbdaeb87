import dataclasses

import pytest

from zipage_jax.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (sp.seed, sp.stop, sp.stop_token_ids, sp.ignore_eos) == (None, (), (), False)
    assert (sp.min_tokens, sp.max_tokens, sp.logprobs, sp.kv_budget) == (0, 16, None, None)
    assert sp.prompt_logprobs is None
    assert sp.skip_special_tokens and not sp.include_stop_str_in_output
    assert not sp.greedy and SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    sp = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(sp.temperature, float) and isinstance(sp.repetition_penalty, float)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    assert SamplingParams(kv_budget=0).kv_budget == 0 and SamplingParams(seed=-3).seed == -3
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16


def test_the_bounds_themselves_are_accepted():
    """The largest values each field takes: what the sampler's int32 / uint32 / float32 arrays hold."""
    top = SamplingParams(n=128, top_k=2**31 - 1, seed=2**63 - 1, max_tokens=2**31 - 1, min_tokens=2**31 - 1,
                         kv_budget=2**31 - 1, temperature=3.4028234663852886e38, stop=["s" * 256] * 16,
                         stop_token_ids=[2**31 - 1] * 64, forced_token_ids=[2**31 - 1])
    assert (top.n, top.top_k, top.seed, len(top.stop), len(top.stop_token_ids)) == (128, 2**31 - 1, 2**63 - 1, 16, 64)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(stop="\U0001F600").stop == ("\U0001F600",)  # a character beyond the BMP is fine


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5
    assert dataclasses.replace(SamplingParams(stop="x"), n=2).stop == ("x",)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, r"n must be in \[1, 128\], got 0"),
        ({"n": 2**70}, r"n must be in \[1, 128\], got 1180591620717411303424"),
        ({"n": 2**200}, r"n must be in \[1, 128\], got an integer of 201 bits"),
        ({"n": 1.0}, "n must be an integer, got 1.0"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 3.40282e\+38\], got -0.1"),
        ({"temperature": 1e39}, r"temperature must be in \[0, 3.40282e\+38\], got 1e\+39"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": "1"}, "temperature must be a finite number, got '1'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -2}, r"top_k must be in \[-1, 2147483647\], got -2"),
        ({"top_k": 2**31}, r"top_k must be in \[-1, 2147483647\], got 2147483648"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"min_p": -0.5}, r"min_p must be in \[0, 1\], got -0.5"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 3.40282e\+38\], got 0.0"),
        ({"repetition_penalty": 1e39}, r"repetition_penalty must be in \(0, 3.40282e\+38\], got 1e\+39"),
        ({"repetition_penalty": -1}, r"repetition_penalty must be in \(0, 3.40282e\+38\], got -1.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
        ({"frequency_penalty": True}, "frequency_penalty must be a finite number, got True"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"seed": 2**63}, r"seed must be in \[-9223372036854775808, 9223372036854775807\], got 9223372036854775808"),
        ({"seed": -(2**63) - 1}, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 3]}, r"stop must be a string or a list of strings, got \['a', 3\]"),
        ({"stop": ["a", ""]}, "stop must not contain an empty string"),
        ({"stop": ["ok", "\ud800"]}, r"stop is not valid Unicode \(a lone surrogate at index 0\)"),
        ({"stop_token_ids": [1, -1]}, r"stop_token_ids must be a list of integers in \[0, 2147483647\]"),
        ({"stop_token_ids": [2**40]},
         r"stop_token_ids must be a list of integers in \[0, 2147483647\], got \[1099511627776\]"),
        ({"stop_token_ids": [1] * 65}, "stop_token_ids holds 65 ids, more than 64"),
        ({"forced_token_ids": [2**31]}, r"forced_token_ids must be a list of integers in \[0, 2147483647\]"),
        ({"stop_token_ids": 7}, r"stop_token_ids must be a list of integers in \[0, 2147483647\], got 7"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
        ({"max_tokens": 0}, r"max_tokens must be in \[1, 2147483647\], got 0"),
        ({"max_tokens": 2**31}, r"max_tokens must be in \[1, 2147483647\], got 2147483648"),
        ({"max_tokens": None}, "max_tokens must be an integer, got None"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, 2147483647\], got -1"),
        ({"min_tokens": 17}, "min_tokens must be <= max_tokens=16, got 17"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
        ({"logprobs": True}, "logprobs must be an integer, got True"),
        ({"prompt_logprobs": 21}, r"^prompt_logprobs must be in \[0, 20\], got 21"),
        ({"prompt_logprobs": -1}, r"^prompt_logprobs must be in \[0, 20\], got -1"),
        ({"prompt_logprobs": False}, "^prompt_logprobs must be an integer, got False"),
        ({"prompt_logprobs": 1.0}, "^prompt_logprobs must be an integer, got 1.0"),
        ({"kv_budget": -1}, r"kv_budget must be in \[0, 2147483647\], got -1"),
        ({"kv_budget": 2**31}, r"kv_budget must be in \[0, 2147483647\], got 2147483648"),
        ({"kv_budget": 1.5}, "kv_budget must be an integer, got 1.5"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
