"""tool_choice "auto" through the server, with the official openai client: a server with
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 whose model output
is scripted token by token (ScriptedEngine: each test sets the script), so the markers and the
calls' arguments arrive split over many deltas (streams are paced so that the server keeps up: a
chunk per token)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from scripted_engine import ScriptedEngine
from server_harness import MODEL, USER, running_server, serve, slow_steps

from zipage_jax.cli import build_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}}
PARIS = {"city": "Paris", "days": 3}
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CALL_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
LONG_TEXT = "All work and no play makes Jack a dull boy, all work and no play."
WRITE_ARGS = {"path": "notes/jack.txt", "text": LONG_TEXT}
CALL_WRITE = ('<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps(WRITE_ARGS) + "}\n</tool_call>")
MARKER_PIECES = ("<t", "<tool", "</", "tool_call>", "<think", "</think")


@pytest.fixture(scope="module")
def server(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir, engine_class=ScriptedEngine,
                        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3") as srv:
        yield srv


def chat(server, script: str, **fields):
    server.engine.script = script
    fields = {"tools": [WEATHER, TIME], "max_tokens": 200, **fields}
    return server.client.chat.completions.create(model=MODEL, messages=USER, **fields)


def arguments(call) -> dict:
    return json.loads(call.function.arguments)


def test_auto_returns_the_parsed_call_and_keeps_special_tokens(server):
    response = chat(server, CALL_PARIS, tool_choice="auto")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert call.function.name == "get_weather" and arguments(call) == PARIS
    assert server.engine.last_params.skip_special_tokens is False  # markers may be special tokens
    assert server.engine.last_params.structured_outputs is None  # no strict tool: free output


def test_tools_without_tool_choice_mean_auto(server):
    response = chat(server, "Let me check.\n" + CALL_PARIS)
    message = response.choices[0].message
    assert message.content == "Let me check.\n" and arguments(message.tool_calls[0]) == PARIS


def test_two_calls_and_text_after_them(server):
    response = chat(server, CALL_PARIS + "\n" + CALL_TIME + "\n\nDone.")
    message = response.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert arguments(message.tool_calls[1]) == {"zone": "CET"}
    assert len({c.id for c in message.tool_calls}) == 2
    assert message.content == "Done." and response.choices[0].finish_reason == "tool_calls"


def test_text_without_calls_is_content(server):
    for script in ("No tool needed: it is sunny.", CALL_PARIS.replace('"get_weather"', "get_weather")):
        choice = chat(server, script).choices[0]
        assert choice.message.content == script and choice.message.tool_calls is None  # malformed: text
        assert choice.finish_reason == "stop"


STEP_S = 0.01  # a scripted step's time when streaming: the server keeps up, a chunk per token


def stream_chunks(server, script: str, **fields) -> list:
    server.engine.script = script
    fields = {"tools": [WEATHER, TIME, WRITE], "max_tokens": 200, **fields}
    with slow_steps(server, STEP_S):
        return list(server.client.chat.completions.create(model=MODEL, messages=USER, stream=True, **fields))


def accumulated(chunks):
    """The client's own accumulation of a stream: the choice it makes of the chunks."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def test_a_streamed_call_comes_as_id_and_name_then_its_arguments_as_written(server):
    script = "Let me check.\n" + CALL_WRITE + "\n" + CALL_TIME
    whole = chat(server, script, tools=[WEATHER, TIME, WRITE]).choices[0].message
    chunks = stream_chunks(server, script, stream_options={"include_usage": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    contents = [d.content for d in deltas if d.content]
    assert "".join(contents) == "Let me check.\n"
    assert [len(d.tool_calls) for d in deltas if d.tool_calls] == [1] * sum(bool(d.tool_calls) for d in deltas)
    entries = [tc for d in deltas for tc in d.tool_calls or []]
    for index, (name, args) in enumerate([("write_file", WRITE_ARGS), ("get_time", {"zone": "CET"})]):
        first, *rest = [e for e in entries if e.index == index]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name == name and first.function.arguments == ""
        assert all(e.id is None and e.type is None and e.function.name is None for e in rest)
        pieces = [e.function.arguments for e in rest]
        assert "".join(pieces) == whole.tool_calls[index].function.arguments and json.loads("".join(pieces)) == args
        assert not any(marker in piece for piece in pieces + contents for marker in MARKER_PIECES)
    assert len([e for e in entries if e.index == 0]) > 20  # the long arguments came as they were written
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens > 0
    message = accumulated(chunks).message
    assert message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("write_file", WRITE_ARGS), ("get_time", {"zone": "CET"})]


def tokens_until(server, script: str, piece: str) -> int:
    """The fewest of the script's tokens whose text holds `piece`."""
    tokenizer = server.engine.tokenizer
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]
    return next(n for n in range(len(ids) + 1) if piece in tokenizer.decode(ids[:n]))


def test_streamed_and_whole_responses_agree(server):
    malformed = CALL_PARIS.replace('"days": 3}', '"days": 3,,}')  # the JSON breaks after the name
    cut_in_arguments = {"max_tokens": tokens_until(server, CALL_WRITE, "Jack a dull")}
    for script, fields in [("plain <tool text", {}), ("a" + CALL_PARIS + "b", {}), (CALL_PARIS[:-4], {}),
                           (malformed, {}), (CALL_WRITE, cut_in_arguments)]:
        whole = chat(server, script, **fields).choices[0]
        streamed = accumulated(stream_chunks(server, script, tools=[WEATHER], **fields))
        assert (streamed.message.content or None) == whole.message.content, script  # the opening delta has ""
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert streamed.finish_reason == whole.finish_reason
    assert whole.message.tool_calls[0].function.arguments.endswith("Jack a dull")  # cut short: the text written
    assert whole.finish_reason == "tool_calls"


def test_each_of_n_choices_has_its_own_calls(server):
    server.engine.script = CALL_PARIS
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, n=2,
                                                        tools=[WEATHER], stream=True))
    ids = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for entry in choice.delta.tool_calls or []:
                if entry.id:
                    ids.setdefault(choice.index, []).append(entry.id)
    assert sorted(ids) == [0, 1] and all(len(v) == 1 for v in ids.values()) and ids[0] != ids[1]
    whole = chat(server, CALL_PARIS, n=2)
    assert [arguments(c.message.tool_calls[0]) for c in whole.choices] == [PARIS, PARIS]


def test_max_tokens_after_a_call_still_finishes_with_tool_calls(server):
    script = CALL_PARIS + "\nand some more text that is cut"
    num_tokens = len(server.engine.tokenizer(CALL_PARIS + "\nand", add_special_tokens=False)["input_ids"])
    choice = chat(server, script, max_tokens=num_tokens).choices[0]
    assert choice.finish_reason == "tool_calls" and arguments(choice.message.tool_calls[0]) == PARIS  # as vLLM
    before_the_name = tokens_until(server, script, '"get_weath')
    cut_inside = chat(server, script, max_tokens=before_the_name).choices[0]
    assert cut_inside.finish_reason == "length" and cut_inside.message.tool_calls is None
    assert cut_inside.message.content.startswith("<tool_call>")


def test_none_leaves_the_output_unparsed(server):
    choice = chat(server, CALL_PARIS, tool_choice="none").choices[0]
    assert choice.message.content == CALL_PARIS and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert server.engine.last_params.skip_special_tokens is True


def test_a_strict_tool_constrains_the_output_with_the_parsers_grammar(server):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    response = chat(server, CALL_PARIS, tools=[strict, TIME])  # admitted: the engine compiled the grammar
    assert arguments(response.choices[0].message.tool_calls[0]) == PARIS
    grammar = server.engine.last_params.structured_outputs.grammar
    assert '"const": "get_weather"' in grammar and '"city": {"type": "string"}' in grammar
    assert grammar.startswith("start: (reasoning BLANKS)? answer")  # the qwen3 reasoning may come first
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, CALL_PARIS, tools=[strict], response_format={"type": "json_object"})
    assert info.value.body["param"] == "tools"


def test_calls_are_read_after_the_reasoning_only(server):
    script = "<think>\nMaybe " + CALL_TIME + "? No.\n</think>\n\n" + CALL_PARIS
    message = chat(server, script).choices[0].message
    assert message.reasoning_content == "\nMaybe " + CALL_TIME + "? No.\n"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] and message.content is None
    server.engine.script = script
    deltas = [c.choices[0].delta for c in server.client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, tools=[WEATHER, TIME], stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert [tc.function.name for d in deltas for tc in d.tool_calls or [] if tc.function.name] == ["get_weather"]


def test_required_reads_its_json_after_the_reasoning(server):
    script = '<think>x</think>\n\n[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    choice = chat(server, script, tool_choice="required").choices[0]
    assert choice.message.reasoning_content == "x" and choice.finish_reason == "tool_calls"
    assert arguments(choice.message.tool_calls[0]) == {"zone": "UTC"}


def test_the_serve_flags():
    parser, _ = build_parser(["serve"])
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                              "--reasoning-parser", "deepseek_r1"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (
        True, "llama3_json", "deepseek_r1")
    args = parser.parse_args(["serve"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (False, None, None)


@pytest.mark.parametrize("argv, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (one of: hermes, llama3_json, "
                                      "openai, pythonic)"),
    (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
    (["--reasoning-parser", "nope"], "invalid choice: 'nope'")])
def test_serve_refuses_bad_parser_flags_at_startup(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        serve(*argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
