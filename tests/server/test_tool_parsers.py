"""Tool-call parsers (zipage_jax/server/tool_parsers): each format's content and calls for whole
outputs, the same for the output streamed in every two-piece split and one character at a time
(no delta holds a piece of a marker), and the strict grammars checked token by token with the
engine's grammar matcher."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest
from output_parsing import WEATHER_PARAMS, accepts, call_schema, random_output, splits, tiny_grammar_compiler

from zipage_jax.engine.grammar import JSON_OPTIONS
from zipage_jax.server.structured import JSON_LAYOUT
from zipage_jax.server.tool_parsers import TOOL_PARSERS, ParsedToolCall, get_tool_parser

HERMES = get_tool_parser("hermes")()
LLAMA = get_tool_parser("llama3_json")()


def call(name: str, arguments: dict) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
# (output, content, calls)
HERMES_CASES = [
    ("Hello there, no tools needed.", "Hello there, no tools needed.", []),
    (block(WEATHER), None, [call("get_weather", {"city": "Paris", "days": 3})]),
    ("Let me check.\n" + block(WEATHER), "Let me check.\n", [call("get_weather", {"city": "Paris", "days": 3})]),
    (block(WEATHER) + "\n" + block(TIME), None,
     [call("get_weather", {"city": "Paris", "days": 3}), call("get_time", {"zone": "CET"})]),
    (block(WEATHER) + "\n\nDone.", "Done.", [call("get_weather", {"city": "Paris", "days": 3})]),
    ("<tool_call>\n" + TIME, None, [call("get_time", {"zone": "CET"})]),  # an unclosed last block, JSON complete
    ("<tool_call>\n" + TIME + "\n</tool_", None, [call("get_time", {"zone": "CET"})]),  # cut inside the end tag
    ('Hi <tool_call>\n{"name": "get_time", "argu', 'Hi <tool_call>\n{"name": "get_time", "argu', []),  # cut short
    (block("{not json}") + " after", block("{not json}") + " after", []),  # malformed: text, tag included
    (block('["a list"]') + block(TIME), block('["a list"]'), [call("get_time", {"zone": "CET"})]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [call("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [call("f", {"x": 1})]),
    (block('{"name": "f"}'), None, [call("f", {})]),
    (block('{"name": "say", "arguments": {"text": "Zürich {\\"<tool_call>\\"}"}}'), None,
     [call("say", {"text": 'Zürich {"<tool_call>"}'})]),
    ("a < b and c <tool_ok> <tool_call", "a < b and c <tool_ok> <tool_call", []),
    ("", None, []),
]
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_CASES = [
    ("The weather is nice.", "The weather is nice.", []),
    ("  \n  Indented answer", "  \n  Indented answer", []),
    (LLAMA_CALL, None, [call("get_weather", {"city": "Paris"})]),
    ("\n <|python_tag|>" + LLAMA_CALL, None, [call("get_weather", {"city": "Paris"})]),
    (LLAMA_CALL + "; " + '{"name": "get_time", "arguments": {"zone": "CET"}}', None,
     [call("get_weather", {"city": "Paris"}), call("get_time", {"zone": "CET"})]),
    ('{"name": "f", "parameters": {"s": "a}b{\\"c"}}', None, [call("f", {"s": 'a}b{"c'})]),
    (LLAMA_CALL + " That is all.", "That is all.", [call("get_weather", {"city": "Paris"})]),
    (LLAMA_CALL + '; {"name": 3}', '{"name": 3}', [call("get_weather", {"city": "Paris"})]),
    ('{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut short
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|pyth", "<|pyth", []),
    ("<|python_tag|> print(1)", "<|python_tag|> print(1)", []),
    ("", None, []),
]
MARKERS = {"hermes": ["<tool_call>", "</tool_call>"], "llama3_json": ["<|python_tag|>"]}


def stream(parser, pieces: list[str]) -> tuple[list[str], list[ParsedToolCall], list[int]]:
    """The content deltas, the calls, and after which piece each call came."""
    state = parser.stream()
    contents, calls, when = [], [], []
    for i, piece in enumerate(pieces + [None]):
        delta = state.feed(piece) if piece is not None else state.finish()
        contents.append(delta.content)
        calls += delta.calls
        when += [i] * len(delta.calls)
    return contents, calls, when


@pytest.mark.parametrize("parser, cases", [(HERMES, HERMES_CASES), (LLAMA, LLAMA_CASES)], ids=["hermes", "llama3_json"])
def test_whole_outputs(parser, cases):
    for text, content, calls in cases:
        assert parser.extract(text) == (content, calls), text


@pytest.mark.parametrize("parser, cases", [(HERMES, HERMES_CASES), (LLAMA, LLAMA_CASES)], ids=["hermes", "llama3_json"])
def test_streams_give_the_whole_output_result_at_every_split(parser, cases):
    for text, content, calls in cases:
        for pieces in splits(text):
            contents, streamed, _ = stream(parser, pieces)
            assert ("".join(contents) or None, streamed) == (content, calls), pieces
            for delta in contents:  # no piece of a marker that the content does not hold itself
                for marker in MARKERS[parser.name]:
                    for length in range(2, len(marker) + 1):
                        assert marker[:length] not in delta or marker[:length] in (content or ""), (pieces, delta)


def test_content_streams_at_once_and_only_a_possible_marker_waits():
    state = HERMES.stream()
    assert state.feed("Hello wor").content == "Hello wor"
    assert state.feed("ld <tool").content == "ld "
    assert state.feed("box>").content == "<toolbox>"
    assert state.feed("<").content == ""
    assert state.finish().content == "<"
    state = LLAMA.stream()
    assert state.feed("  ").content == ""  # may precede a call
    assert state.feed("Sure").content == "  Sure"


def test_a_call_comes_as_soon_as_its_block_or_object_closes():
    text = "Checking." + block(WEATHER) + "\n" + block(TIME)
    first_end = text.index("</tool_call>") + len("</tool_call>")
    _, calls, when = stream(HERMES, [text[:first_end], text[first_end:-1], text[-1:]])
    assert [c.name for c in calls] == ["get_weather", "get_time"] and when == [0, 2]
    text = LLAMA_CALL + "; " + LLAMA_CALL
    _, calls, when = stream(LLAMA, [text[:len(LLAMA_CALL)], text[len(LLAMA_CALL):]])
    assert len(calls) == 2 and when == [0, 1]


def test_the_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    assert all(TOOL_PARSERS[name].name == name for name in TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose from hermes, llama3_json"):
        get_tool_parser("nope")


# --- strict grammars, token by token through the engine's matcher on the tiny tokenizer
@pytest.fixture(scope="module")
def compiler():
    return tiny_grammar_compiler()


@pytest.mark.parametrize("parser, good, bad", [
    (HERMES,
     ["Just text.", "Let me see." + block('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}') + " ok",
      block('{"name": "get_time", "arguments": {"any": [1]}}') + "\n" + block(
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}')],
     [block('{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'),
      block('{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
      block('{"name": "other", "arguments": {}}'),
      "x" + block('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}')[:-3]]),
    (LLAMA,
     ["Just text.", "  indented {text}", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
      '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}'],
     ['{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
      '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}} trailing',
      '{"answer": 42}']),
], ids=["hermes", "llama3_json"])
def test_strict_grammars_constrain_the_strict_tools_arguments(compiler, parser, good, bad):
    grammar = parser.grammar(call_schema(parser.arguments_key))
    for text in good:
        assert accepts(compiler, grammar, text), text
        assert all(call.name in ("get_weather", "get_time") for call in parser.extract(text)[1])
    for text in bad:
        assert not accepts(compiler, grammar, text), text


def test_calls_drawn_at_random_through_a_strict_grammar_always_validate(compiler):
    schema = {**call_schema("arguments"), "anyOf": call_schema("arguments")["anyOf"][:1]}  # get_weather alone
    grammar = HERMES.grammar(schema)
    rng = random.Random(0)
    outputs = [random_output(compiler, grammar, "Sure. <tool_call>", rng, stop="</tool_call>") for _ in range(20)]
    assert sum(output is not None for output in outputs) >= 15
    for output in filter(None, outputs):
        content, (call,) = HERMES.extract(output)
        assert content == "Sure. " and call.name == "get_weather"
        jsonschema_rs.validate(WEATHER_PARAMS, json.loads(call.arguments))


def test_the_json_layout_is_the_engines():
    assert JSON_LAYOUT == JSON_OPTIONS
