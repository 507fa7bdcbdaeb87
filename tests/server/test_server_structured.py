"""Structured outputs through the server, with the official openai client: response_format
(text, json_object, json_schema), vLLM's structured_outputs (regex, choice), and tools with
tool_choice "required" or a named function. Each output is checked by an independent parser:
json and jsonschema_rs (schemas), re (regexes)."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import openai
import pytest
from server_harness import MODEL, USER

SAMPLED = dict(temperature=1.0, seed=7)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False},
}, "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_json_schema_outputs_validate_for_every_completion(server):
    response = server.client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=120, n=3, **SAMPLED,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(response.choices) == 3
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema_rs.validate(PERSON, json.loads(choice.message.content))


def test_json_object_and_text_formats(server):
    obj = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, **SAMPLED,
                                                response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    text = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0,
                                                 response_format={"type": "text"})
    plain = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert text.choices[0].message.content == plain.choices[0].message.content  # "text" changes nothing


def test_structured_outputs_regex_and_choice_on_completions(server):
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    out = server.client.completions.create(model=MODEL, prompt="id:", max_tokens=16, n=2, **SAMPLED,
                                           extra_body={"structured_outputs": {"regex": pattern}})
    for choice in out.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
    choices = ["yes", "no", "maybe so"]
    out = server.client.completions.create(model=MODEL, prompt="answer:", max_tokens=16, n=3, **SAMPLED,
                                           extra_body={"structured_outputs": {"choice": choices}})
    assert all(choice.text in choices for choice in out.choices)


def test_streamed_json_schema_output_validates(server):
    stream = server.client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=120, stream=True, **SAMPLED,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema_rs.validate(PERSON, json.loads(text))


def test_tool_choice_required_returns_tool_calls_of_the_tools(server):
    response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=160, **SAMPLED,
                                                     tools=[WEATHER, TIME], tool_choice="required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema_rs.validate(schemas[call.function.name], json.loads(call.function.arguments))


def test_a_named_tool_choice_calls_that_function(server):
    response = server.client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=80, **SAMPLED, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(call.function.arguments))
    assert response.choices[0].finish_reason == "stop"  # OpenAI's for a named tool choice


def test_streamed_tool_calls_arrive_whole_in_a_delta(server):
    stream = server.client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=80, stream=True, **SAMPLED, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema_rs.validate(WEATHER["function"]["parameters"], json.loads(calls[0].function.arguments))
    assert all(not c.choices[0].delta.content for c in chunks)


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema"),
    (dict(tools=[WEATHER], tool_choice="auto"), "tool_choice"),
    (dict(tools=[WEATHER]), "tool_choice"),  # the default for tools is "auto"
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
])
def test_bad_structured_requests_are_400s_naming_the_parameter(server, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **fields)
    assert info.value.body["param"] == param, info.value.body


def test_tool_choice_none_ignores_the_tools(server):
    response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0,
                                                     tools=[WEATHER], tool_choice="none")
    assert response.choices[0].message.tool_calls is None and response.choices[0].message.content is not None


def test_a_conversation_with_earlier_tool_calls_is_accepted(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                     tools=[WEATHER], tool_choice="none")
    assert response.choices[0].finish_reason == "length"


def test_without_parallel_tool_calls_required_makes_one_call(server):
    for seed in range(3):
        response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=160, temperature=1,
                                                         seed=seed, tools=[WEATHER, TIME], tool_choice="required",
                                                         parallel_tool_calls=False)
        assert len(response.choices[0].message.tool_calls) == 1
