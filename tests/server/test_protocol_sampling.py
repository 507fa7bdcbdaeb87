"""The request models and SamplingParams kept in step: every sampling field a request model has
reaches SamplingParams, and each numeric bound (sampling_params.BOUNDS) is refused alike by the
server's 400 and by SamplingParams."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from zipage_jax.sampling_params import BOUNDS, INT32_MAX, Bound, SamplingParams
from zipage_jax.server.errors import validation_error
from zipage_jax.server.protocol import ChatCompletionRequest, CompletionRequest, sampling_fields

MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {CompletionRequest: {"model": "m", "prompt": "x"}, ChatCompletionRequest: {"model": "m", "messages": MESSAGES}}


def base(model) -> dict:
    return next(body for parent, body in BASE.items() if issubclass(model, parent))

# A value other than the default for every field a request copies into SamplingParams (in two
# requests: kv_budget_max bounds an automatic budget, keep_prompt goes with either).
COMMON = {
    "n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 11, "stop": ["END"], "stop_token_ids": [5],
    "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True,
    "eviction_policy": "streaming", "prompt_compression": "deferred", "prompt_logprobs": 1,
}
EXAMPLES = [{**COMMON, "kv_budget": "auto", "kv_budget_max": 512}, {**COMMON, "kv_budget": 64, "keep_prompt": True}]
TUPLES = {"stop": ("END",), "stop_token_ids": (5,)}  # SamplingParams keeps sequences as tuples


def parse(model, **fields):
    return model.model_validate_json(json.dumps({**base(model), **fields}))


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest], ids=lambda m: m.__name__)
def test_every_sampling_field_of_a_request_reaches_sampling_params(model):
    assert set(sampling_fields(model)) == set(EXAMPLES[0]) | set(EXAMPLES[1])
    defaults = parse(model).sampling_params(8, None)
    for fields in EXAMPLES:
        params = parse(model, **fields).sampling_params(8, None)
        expected = {**fields, **TUPLES}
        assert {name: getattr(params, name) for name in fields} == expected
        assert all(getattr(defaults, name) != value for name, value in expected.items())  # none is a default


def test_a_field_added_to_a_request_model_reaches_sampling_params():
    class WithForcing(CompletionRequest):
        forced_token_ids: list[int] | None = None

    assert parse(WithForcing, forced_token_ids=[5, 6]).sampling_params(8, None).forced_token_ids == (5, 6)
    with pytest.raises(ValidationError, match="forced_token_ids"):  # control: the field is new to the request
        parse(CompletionRequest, forced_token_ids=[5, 6])


# (request model, its field, the SamplingParams field whose bound it carries)
BOUNDED = [(ChatCompletionRequest, name, name) for name in BOUNDS if name != "logprobs"] + [
    (CompletionRequest, "logprobs", "logprobs"),
    (ChatCompletionRequest, "top_logprobs", "logprobs"),
    (ChatCompletionRequest, "max_completion_tokens", "max_tokens"),
]
# what a field's extreme values need beside them to be valid
CONTEXT = {"min_tokens": {"max_tokens": INT32_MAX}, "kv_budget_max": {"kv_budget": "auto"}}


def outside(bound: Bound) -> list[tuple[str, int | float]]:
    """(side, value) just past each end of the bound."""
    step = 1 if not bound.real else 0 if bound.low_open else 1.0
    return [("low", bound.low - step), ("high", bound.high * 2 if bound.real else bound.high + 1)]


def inside(bound: Bound) -> list[int | float]:
    return [bound.low + 1e-6 if bound.low_open else bound.low, bound.high]


def server_error(model, field: str, value) -> tuple[str, str]:
    """(param, message) of the server's 400 for the request with `field` = value."""
    with pytest.raises(ValidationError) as info:
        parse(model, **{field: value})
    error = validation_error(RequestValidationError(info.value.errors(include_url=False)))
    assert error.status == 400
    return error.param, error.message


@pytest.mark.parametrize("model, field, name", BOUNDED, ids=[f"{m.__name__}.{f}" for m, f, _ in BOUNDED])
def test_the_server_and_sampling_params_refuse_each_bound_alike(model, field, name):
    bound, context = BOUNDS[name], CONTEXT.get(name, {})
    for side, value in outside(bound):
        end = bound.low if side == "low" else bound.high
        param, message = server_error(model, field, value)
        relation = ("greater than" + ("" if bound.low_open else " or equal to") if side == "low"
                    else "less than or equal to")
        assert param == field and f": Input should be {relation} " in message  # after the field's location
        assert float(message.rsplit(" ", 1)[1]) == pytest.approx(end)
        with pytest.raises(ValueError) as info:
            SamplingParams(**{**context, name: value})
        stated = re.fullmatch(rf"{name} must be in ([\[(])(\S+), (\S+)\], got .+", str(info.value))
        assert stated, str(info.value)
        assert stated[1] == ("(" if bound.low_open else "[")
        assert (float(stated[2]), float(stated[3])) == pytest.approx((bound.low, bound.high), rel=1e-5)
    for value in inside(bound):  # control: the ends themselves pass both
        parse(model, **{**context, field: value})
        assert getattr(SamplingParams(**{**context, name: value}), name) == value
