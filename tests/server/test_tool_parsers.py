"""Tool-call parsers (zipage_jax/server/tool_parsers): each format's content and calls for whole
outputs, the same for the output streamed in every two-piece split and one character at a time
(a call's name first, then its arguments as they are written; no delta holds a piece of a
marker), and the strict grammars checked token by token with the engine's grammar matcher."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest
from output_parsing import WEATHER_PARAMS, accepts, call_schema, random_output, splits, tiny_grammar_compiler

from zipage_jax.engine.grammar import JSON_OPTIONS
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import Tool
from zipage_jax.server.structured import JSON_LAYOUT, grammar
from zipage_jax.server.tool_parsers import TOOL_PARSERS, ToolCallPiece, get_tool_parser, whole_calls

HERMES = get_tool_parser("hermes")()
LLAMA = get_tool_parser("llama3_json")()


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
PARIS = ("get_weather", {"city": "Paris", "days": 3})
CET = ("get_time", {"zone": "CET"})
# (output, content, calls): a call's arguments are the object the model wrote (its text as json.dumps
# writes it), or the text itself where that is not json.dumps's (other spacing, or malformed)
HERMES_CASES = [
    ("Hello there, no tools needed.", "Hello there, no tools needed.", []),
    (block(WEATHER), None, [PARIS]),
    ("Let me check.\n" + block(WEATHER), "Let me check.\n", [PARIS]),
    (block(WEATHER) + "\n" + block(TIME), None, [PARIS, CET]),
    (block(WEATHER) + "\n\nDone.", "Done.", [PARIS]),
    ("<tool_call>\n" + TIME, None, [CET]),  # an unclosed last block
    ("<tool_call>\n" + TIME + "\n</tool_", None, [CET]),  # cut inside the end tag
    (block('{ "name" :"f","arguments":{ "a" :[1,2] , "b": "}"}}'), None, [("f", '{ "a" :[1,2] , "b": "}"}')]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),  # a string
    (block('{"arguments": {"x": 1}, "name": "f"}'), None, [("f", {"x": 1})]),  # the name last: whole at the end
    (block('{"name": "f"}'), None, [("f", {})]),
    (block('{"id": 7, "name": "f", "arguments": {"x": {"y": []}}}'), None, [("f", {"x": {"y": []}})]),
    (block('{"name": "say", "arguments": {"text": "Zürich {\\"<tool_call>\\"} a < b"}}'), None,
     [("say", {"text": 'Zürich {"<tool_call>"} a < b'})]),
    # the name known, then the JSON breaks or the output ends: the call stands with the text written
    ('Hi <tool_call>\n{"name": "get_time", "argu', "Hi ", [("get_time", {})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call> b', "b", [("f", '{"a": "x')]),
    (block('{"name": "f", "arguments": {"a": 1}, oops}') + " ok", "ok", [("f", {"a": 1})]),
    (block('{"name": "f", "arguments": null}'), None, [("f", {})]),
    # no name known: the block is text, tags included
    ('Hi <tool_call>\n{"name": "get_ti', 'Hi <tool_call>\n{"name": "get_ti', []),
    (block("{not json}") + " after", block("{not json}") + " after", []),
    (block('["a list"]') + block(TIME), block('["a list"]'), [CET]),
    (block('{"x" 1, "name": "f", "arguments": {}}'), block('{"x" 1, "name": "f", "arguments": {}}'), []),
    (block('{"name": "", "arguments": {}}'), block('{"name": "", "arguments": {}}'), []),
    (block('{"arguments": {"x": 1}, "name": 3}'), block('{"arguments": {"x": 1}, "name": 3}'), []),
    ("a < b and c <tool_ok> <tool_call", "a < b and c <tool_ok> <tool_call", []),
    ("", None, []),
]
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
IN_PARIS = ("get_weather", {"city": "Paris"})
LLAMA_CASES = [
    ("The weather is nice.", "The weather is nice.", []),
    ("  \n  Indented answer", "  \n  Indented answer", []),
    (LLAMA_CALL, None, [IN_PARIS]),
    ("\n <|python_tag|>" + LLAMA_CALL, None, [IN_PARIS]),
    (LLAMA_CALL + "; " + '{"name": "get_time", "arguments": {"zone": "CET"}}', None, [IN_PARIS, CET]),
    ('{"name": "f", "parameters": {"s": "a}b{\\"c"}}', None, [("f", {"s": 'a}b{"c'})]),
    (LLAMA_CALL + " That is all.", "That is all.", [IN_PARIS]),
    (LLAMA_CALL + '; {"name": 3}', '{"name": 3}', [IN_PARIS]),
    ('{"parameters": {"a": 1}, "name": "f"}', None, [("f", {"a": 1})]),
    ('{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    ('{"name": "f", "parameters": {"a": ', None, [("f", '{"a": ')]),  # cut short after the name
    ('{"name": "f", "parameters": {"a": 1}, oops} Bye', "Bye", [("f", {"a": 1})]),
    ('{"name": "f", "param', None, [("f", {})]),
    ('{"name": "f', '{"name": "f', []),  # cut short before the name is known
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|pyth", "<|pyth", []),
    ("<|python_tag|> print(1)", "<|python_tag|> print(1)", []),
    ("", None, []),
]
OPENAI = get_tool_parser("openai")()
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
THINKING = "<|channel|>analysis<|message|>Need the weather.<|end|>"
OPENAI_CASES = [
    ("It is sunny.", "It is sunny.", []),  # the final channel's answer, as the reasoning parser leaves it
    (CALL_HEADER.format("get_weather") + '{"city": "Paris", "days": 3}<|call|>', None, [PARIS]),
    (CALL_HEADER.format("get_weather") + '{"city": "Paris", "days": 3}', None, [PARIS]),  # <|call|>: a stop token
    (THINKING + CALL_HEADER.format("get_time") + '{"zone": "CET"}', THINKING, [CET]),  # no reasoning parser
    ("<|channel|>commentary to=functions.f<|message|><|call|>", None, [("f", {})]),
    ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": [1,2]}<|end|>', None,
     [("f", '{"a": [1,2]}')]),
    (CALL_HEADER.format("get_weather") + '{"city": "Par', None, [("get_weather", '{"city": "Par')]),  # cut short
    (CALL_HEADER.format("get_weather") + '{"city": "Paris", "days": 3}<|call|>' + CALL_HEADER.format("get_time")
     + '{"zone": "CET"}<|call|>', None, [PARIS, CET]),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>",
     "<|channel|>commentary to=browser.search<|message|>{}<|call|>", []),  # not a function
    ("<|channel|>commentary to=functions.<|message|>{}", "<|channel|>commentary to=functions.<|message|>{}", []),
    ("a <|chan b <|", "a <|chan b <|", []),
    (CALL_HEADER.format("f")[:30], CALL_HEADER.format("f")[:30], []),  # an unfinished header
    ("", None, []),
]
PYTHONIC = get_tool_parser("pythonic")()
PYTHONIC_CASES = [
    ("Plain answer [not a call]", "Plain answer [not a call]", []),
    ('[get_weather(city="Paris", days=3)]', None, [PARIS]),
    ('\n [get_weather(city="Paris", days=3), get_time(zone="CET")] ', None, [PARIS, CET]),
    ("[f(a=[1, (2, 3)], b={'k': None}, c=True, d=-1.5)]", None,
     [("f", {"a": [1, [2, 3]], "b": {"k": None}, "c": True, "d": -1.5})]),
    ("[f()]", None, [("f", {})]),
    ('[f(a="Zürich")]', None, [("f", {"a": "Zürich"})]),
    # not a list of calls of literals: content as written, and never run
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[f(1)]", "[f(1)]", []),
    ("[f(a=g())]", "[f(a=g())]", []),
    ("[f(a=__import__('os').system('true'))]", "[f(a=__import__('os').system('true'))]", []),
    ("[f(**{'a': 1})]", "[f(**{'a': 1})]", []),
    ("[os.system(a=1)]", "[os.system(a=1)]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set: no JSON
    ("[f(a=1), ", "[f(a=1), ", []),  # cut short
    ("[]", "[]", []),
    ("", None, []),
]
MARKERS = {"hermes": ["<tool_call>", "</tool_call>"], "llama3_json": ["<|python_tag|>"],
           "openai": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"],
           "pythonic": []}
BOTH = pytest.mark.parametrize("parser, cases", [(HERMES, HERMES_CASES), (LLAMA, LLAMA_CASES),
                                                 (OPENAI, OPENAI_CASES), (PYTHONIC, PYTHONIC_CASES)],
                               ids=["hermes", "llama3_json", "openai", "pythonic"])


def arguments_text(arguments: dict | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def stream(parser, pieces: list[str]) -> tuple[list[str], list[list[ToolCallPiece]]]:
    """The content and the call pieces of each delta (the last one: finish's)."""
    state = parser.stream()
    deltas = [state.feed(piece) for piece in pieces] + [state.finish()]
    return [d.content for d in deltas], [d.calls for d in deltas]


@BOTH
def test_whole_outputs(parser, cases):
    for text, content, calls in cases:
        got_content, got_calls = parser.extract(text)
        assert got_content == content, text
        assert [(c.name, c.arguments) for c in got_calls] == [(n, arguments_text(a)) for n, a in calls], text
        for got, (_, arguments) in zip(got_calls, calls):
            if isinstance(arguments, dict):  # what the model wrote, character for character
                assert json.loads(got.arguments) == arguments


@BOTH
def test_streams_give_the_whole_output_result_at_every_split(parser, cases):
    for text, content, calls in cases:
        whole = parser.extract(text)[1]
        for pieces in splits(text):
            contents, call_pieces = stream(parser, pieces)
            flat = [piece for delta in call_pieces for piece in delta]
            assert ("".join(contents) or None, whole_calls(flat)) == (content, whole), pieces
            # each call: a first piece with its name and no arguments, then pieces of its arguments
            assert [p.index for p in flat if p.name is not None] == list(range(len(calls)))
            named = set()
            for p in flat:
                assert (p.name is None) == (p.index in named) == (p.arguments != ""), (pieces, p)
                named.add(p.index)
            # no piece of a marker that the whole content or arguments do not hold themselves
            held = [(c, content or "") for c in contents] + [(p.arguments, whole[p.index].arguments) for p in flat]
            for delta, whole_text in held:
                for marker in MARKERS[parser.name]:
                    for length in range(2, len(marker) + 1):
                        assert marker[:length] not in delta or marker[:length] in whole_text, (pieces, delta)


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


def fed(state, text: str) -> list[tuple[int, str | None, str]]:
    return [(p.index, p.name, p.arguments) for p in state.feed(text).calls]


@pytest.mark.parametrize("parser, opening", [(HERMES, "Checking.<tool_call>\n"), (LLAMA, "<|python_tag|>")],
                         ids=["hermes", "llama3_json"])
def test_a_call_streams_its_name_once_known_then_its_arguments_as_written(parser, opening):
    key = parser.arguments_key
    state = parser.stream()
    assert fed(state, opening + '{"na') == []
    assert fed(state, 'me": "wri') == []
    assert fed(state, 'te') == []
    assert fed(state, '", ') == [(0, "write", "")]  # the name's string has closed
    assert fed(state, f'"{key}": ') == []
    assert fed(state, '{"text": "a lo') == [(0, None, '{"text": "a lo')]
    assert fed(state, 'ng text') == [(0, None, "ng text")]
    assert fed(state, ' with } and {') == [(0, None, " with } and {")]
    assert fed(state, '"}') == [(0, None, '"}')]  # the arguments' object has closed
    assert fed(state, '}') == []
    separator = "\n</tool_call>\n<tool_call>\n" if parser is HERMES else "; "
    assert fed(state, separator + f'{{"{key}": {{"x": 1}}, ') == []  # arguments first: the call comes whole
    assert fed(state, '"name": "f"') == []
    assert fed(state, "}") == [(1, "f", ""), (1, None, '{"x": 1}')]
    assert state.finish().calls == []


def test_hermes_holds_back_only_what_may_start_the_end_tag():
    state = HERMES.stream()
    fed(state, '<tool_call>{"name": "f", "arguments": {"code": "a <')
    assert fed(state, "/") == []
    assert fed(state, "b") == [(0, None, "</b")]
    assert fed(state, '"}}\n</tool_call>') == [(0, None, '"}')]


def test_the_arguments_of_a_string_come_whole_once_it_closes():
    state = HERMES.stream()
    assert fed(state, '<tool_call>{"name": "f", "arguments": "{\\"x\\": ') == [(0, "f", "")]
    assert fed(state, '1}"') == [(0, None, '{"x": 1}')]


def test_the_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "openai", "pythonic"}
    assert all(TOOL_PARSERS[name].name == name for name in TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose from hermes, llama3_json, openai, "
                                         "pythonic"):
        get_tool_parser("nope")


def test_an_openai_call_streams_its_name_from_the_header_then_its_arguments_as_written():
    state = OPENAI.stream()
    assert fed(state, "<|channel|>commentary to=functions.get_ti") == []
    assert fed(state, "me <|constrain|>json<|mess") == []
    assert fed(state, 'age|>{"zone": ') == [(0, "get_time", ""), (0, None, '{"zone": ')]
    assert fed(state, '"CET"}<|ca') == [(0, None, '"CET"}')]
    assert fed(state, "ll|>") == []
    assert state.finish().calls == []


def test_pythonic_holds_a_possible_call_list_to_the_end_and_streams_other_text():
    state = PYTHONIC.stream()
    assert state.feed(" [get_time(zo").content == ""
    assert state.feed('ne="CET")]').calls == []
    assert [(p.index, p.name, p.arguments) for p in state.finish().calls] == \
        [(0, "get_time", ""), (0, None, '{"zone": "CET"}')]
    state = PYTHONIC.stream()
    assert state.feed("  ").content == ""
    assert state.feed("Sure [").content == "  Sure ["


@pytest.mark.parametrize("parser", [OPENAI, PYTHONIC], ids=["openai", "pythonic"])
def test_strict_tools_are_refused_where_the_calls_are_not_json(parser):
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True,
                                                                   "parameters": WEATHER_PARAMS}})]
    with pytest.raises(OpenAIError, match=f"--tool-call-parser {parser.name} .*cannot constrain a strict tool"):
        grammar(None, None, tools, "auto", tool_parser=parser)
    tools[0].function.strict = False  # without strict: no grammar, the parser reads the calls
    assert grammar(None, None, tools, "auto", tool_parser=parser) is None


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
