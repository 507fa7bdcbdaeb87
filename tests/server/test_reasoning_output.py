"""Reasoning output through the server, with the official openai client: a server with
--reasoning-parser deepseek_r1 (and no tool-call parser) whose model output is scripted token by
token (ScriptedEngine: each test sets the script)."""

from __future__ import annotations

import json

import openai
import pytest
from scripted_engine import ScriptedEngine
from server_harness import MODEL, USER, running_server, slow_steps

from zipage_jax.server.chat_output import ChatOutput
from zipage_jax.server.response_builders import ChatBuilder

REASONING = "Two and two.\nThat makes four."
SCRIPT = REASONING + "</think>\n\nThe answer is 4."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir, engine_class=ScriptedEngine,
                        reasoning_parser="deepseek_r1") as srv:
        yield srv


def tokens(server, text: str) -> list[int]:
    return server.engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def reasoning_tokens(server) -> int:
    """The script's tokens up to and including </think>, tokenized on their own (as in the script)."""
    through_tag = tokens(server, REASONING + "</think>")
    assert tokens(server, SCRIPT)[:len(through_tag)] == through_tag
    return len(through_tag)


def test_the_reasoning_is_split_off_and_counted(server):
    server.engine.script = SCRIPT
    response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
    message = response.choices[0].message
    assert message.reasoning_content == REASONING and message.content == "The answer is 4."
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == len(tokens(server, SCRIPT)) + 1  # and EOS
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(server)


def test_a_stream_sends_reasoning_then_content_and_no_piece_of_a_tag(server):
    server.engine.script = SCRIPT
    with slow_steps(server, 0.01):  # the server keeps up: a chunk per token, the tag split over several
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, stream=True,
                                                            stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    contents = [d.content or "" for d in deltas]
    assert "".join(reasoning) == REASONING and "".join(contents) == "The answer is 4."
    assert not any(piece in text for text in reasoning + contents for piece in ("</", "</think", "think>"))
    last_reasoning = max(i for i, text in enumerate(reasoning) if text)
    # reasoning first (a chunk of merged outputs may end the reasoning and start the content)
    assert all(not text for text in contents[:last_reasoning])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(server)


def test_a_think_block_cut_by_max_tokens_is_all_reasoning(server):
    server.engine.script = SCRIPT
    response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content == server.engine.tokenizer.decode(tokens(server, SCRIPT)[:5])
    assert response.usage.completion_tokens_details.reasoning_tokens == 5
    server.engine.script = SCRIPT
    stream = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == choice.message.reasoning_content
    assert not any(d.content for d in deltas)


def test_each_of_n_choices_is_split(server):
    server.engine.script = SCRIPT
    response = server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in response.choices] == [
        (REASONING, "The answer is 4.")] * 2
    assert response.usage.completion_tokens_details.reasoning_tokens == 2 * reasoning_tokens(server)


def test_a_json_schema_applies_after_the_reasoning(server):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    server.engine.script = 'hmm</think>\n\n{"x": 4}'
    response = server.client.chat.completions.create(  # admitted: the engine compiled the grammar
        model=MODEL, messages=USER, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": schema}})
    assert json.loads(response.choices[0].message.content) == {"x": 4}
    assert response.choices[0].message.reasoning_content == "hmm"
    grammar = server.engine.last_params.structured_outputs.grammar
    assert grammar.startswith("start: reasoning BLANKS answer") and '"x": {"type": "integer"}' in grammar


@pytest.mark.parametrize("fields", [dict(tools=[WEATHER], tool_choice="auto"), dict(tools=[WEATHER])])
def test_auto_tool_choice_without_the_flags_is_a_400_naming_them(server, fields):
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **fields)
    body = info.value.body
    assert body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in body["message"] and "--tool-call-parser" in body["message"]


def test_without_a_reasoning_parser_a_message_has_no_reasoning_field():
    builder = ChatBuilder(MODEL, None, "r", ChatOutput())
    message = builder.choice(0, "a</think>b", None, "stop", None).body()["message"]
    assert message == {"role": "assistant", "content": "a</think>b"}
    assert builder.reasoning_tokens(0, [1, 2]) is None
