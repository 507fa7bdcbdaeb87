"""Reasoning parsers (zipage_jax/server/reasoning_parsers): reasoning and content of whole
outputs, the same streamed at every split (no delta holds a piece of a tag), the prompt's own
think tags, the reasoning token count (tags as one token, and as several), and the grammars that
put a structured output after the reasoning, checked token by token with the engine's matcher."""

from __future__ import annotations

import pytest
from output_parsing import WEATHER_PARAMS, accepts, splits, tiny_grammar_compiler
from tiny_models import build_tokenizer

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import JsonSchemaFormat, ResponseFormat, StructuredOutputs, Tool
from zipage_jax.server.reasoning_parsers import REASONING_PARSERS, ReasoningTags, get_reasoning_parser
from zipage_jax.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from zipage_jax.server.structured import grammar
from zipage_jax.server.tool_parsers import get_tool_parser

R1, QWEN3 = get_reasoning_parser("deepseek_r1"), get_reasoning_parser("qwen3")
GPTOSS = get_reasoning_parser("openai_gptoss")
ASSISTANT = "<|start|>assistant"  # the end of a harmony prompt: gpt-oss's template opens its message
THINKS = "<|channel|>analysis<|message|>Think: 2 + 2.<|end|>"
ANSWERS = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALLS = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Paris"}<|call|>')
# (prompt_opened, output, reasoning, content); harmony's: (the prompt from its last <|start|> on, ...)
CASES = {
    R1: [
        (None, "Okay, 2 + 2.</think>\n\nIt is 4.", "Okay, 2 + 2.", "It is 4."),
        (None, "<think>\nhmm\n</think>\n\nAnswer", "\nhmm\n", "Answer"),
        (None, "all reasoning, cut off by max_tokens", "all reasoning, cut off by max_tokens", None),
        (None, "<think>unclosed", "unclosed", None),
        (None, "</think>answer", None, "answer"),
        (None, "a </thin b</think>c</think>d", "a </thin b", "c</think>d"),
        (None, "only blanks follow</think>\n\n", "only blanks follow", None),
        (None, "x</think> \n y \n", "x", "y \n"),
        (None, "<thi", "<thi", None),
        (None, "\nstarts on a new line</think>x", "\nstarts on a new line", "x"),
        (None, "", None, None),
        (False, "no thinking</think> at all", None, "no thinking</think> at all"),  # the template closed it
        (True, "opened by the template</think>ok", "opened by the template", "ok"),
    ],
    QWEN3: [
        (None, "<think>\nhmm\n</think>\n\nAnswer", "\nhmm\n", "Answer"),
        (None, "Answer without thinking", None, "Answer without thinking"),
        (None, "\n\n<think>a</think>b", "a", "b"),
        (None, "<think>unclosed at max_tokens", "unclosed at max_tokens", None),
        (None, "Use <think> tags like this", None, "Use <think> tags like this"),
        (None, "<thi", None, "<thi"),
        (None, "  ", None, "  "),
        (None, "</think>only", None, "</think>only"),
        (True, "opened by the template</think>\n\nok", "opened by the template", "ok"),
        (False, "<think>x</think>y", None, "<think>x</think>y"),
    ],
    GPTOSS: [
        (ASSISTANT, THINKS + ANSWERS + "<|return|>", "Think: 2 + 2.", "It is 4."),
        (ASSISTANT, THINKS + ANSWERS, "Think: 2 + 2.", "It is 4."),  # <|return|> dropped as a stop token
        (ASSISTANT, "<|channel|>analysis<|message|>cut off by max_tokens", "cut off by max_tokens", None),
        (ASSISTANT, "<|channel|>final<|message|>No thinking.<|return|>", None, "No thinking."),
        (ASSISTANT, THINKS + CALLS, "Think: 2 + 2.", CALLS),  # a tool call, as written
        (ASSISTANT, "<|channel|>commentary<|message|>Checking. <|end|>" + ANSWERS, None, "Checking. It is 4."),
        (ASSISTANT, "<|channel|>analysis<|message|>a <|chan b <| c<|end|>", "a <|chan b <| c", None),
        (ASSISTANT, "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b"),
        (ASSISTANT, "<|channel|>analysis<|mess", None, "<|channel|>analysis<|mess"),  # an unfinished header
        (ASSISTANT, "not harmony", None, "not harmony"),
        (ASSISTANT, "", None, None),
        ("", "text " + THINKS + "<|start|>x", "Think: 2 + 2.", "text <|start|>x"),  # the prompt opened no message
        (ASSISTANT + "<|channel|>analysis<|message|>", "opened by the prompt<|end|>" + ANSWERS,
         "opened by the prompt", "It is 4."),
    ],
}
ALL_CASES = [(parser, *case) for parser, cases in CASES.items() for case in cases]
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
TAGS = {R1: ("<think>", "</think>"), QWEN3: ("<think>", "</think>"), GPTOSS: HARMONY_MARKERS}


def case_id(case) -> str:
    return f"{case[0].name}-{case[1]}-{case[2][:12]!r}"


@pytest.mark.parametrize("parser, opened, text, reasoning, content", ALL_CASES, ids=map(case_id, ALL_CASES))
def test_whole_and_streamed_outputs(parser, opened, text, reasoning, content):
    assert parser(opened).extract(text) == (reasoning, content)
    for pieces in splits(text):
        stream = parser(opened).stream()
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        got = "".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None
        assert got == (reasoning, content), pieces
        for delta in deltas:
            for part, whole in ((delta.reasoning, reasoning), (delta.content, content)):
                for tag in TAGS[parser]:
                    for length in range(2, len(tag) + 1):
                        assert tag[:length] not in part or tag[:length] in (whole or ""), (pieces, delta)


@pytest.mark.parametrize("parser, text, ended", [
    (R1, "a</think>b", True), (R1, "a", False), (R1, "", False), (QWEN3, "<think>a</think>b", True),
    (QWEN3, "<think>a", False), (QWEN3, "a", None), (GPTOSS, THINKS + ANSWERS, True),
    (GPTOSS, "<|channel|>analysis<|message|>a", False), (GPTOSS, "<|channel|>final<|message|>a", None)])
def test_a_streams_end_state(parser, text, ended):
    stream = (parser(ASSISTANT) if parser is GPTOSS else parser()).stream()
    stream.feed(text)
    stream.finish()
    assert stream.ended is ended


@pytest.mark.parametrize("tail, opened", [
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False), ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n", None), ("<|im_start|>user\n</think> in a question<|im_end|>\n<|im_start|>assistant\n",
                                         None)])
def test_the_prompt_may_open_or_close_the_think_block(tail, opened):
    tokenizer = build_tokenizer(320)
    prompt = tokenizer("<|im_start|>system\nYou are helpful.<|im_end|>\n" + tail)["input_ids"]
    for parser in (R1, QWEN3):
        assert parser.for_prompt(prompt, tokenizer).prompt_opened is opened


def test_reasoning_tokens_counted_from_the_text_when_the_tags_are_several_tokens():
    tokenizer = build_tokenizer(320)
    assert len(tokenizer("</think>", add_special_tokens=False)["input_ids"]) > 1
    ids = tokenizer("let me think about it</think>\n\nthe answer", add_special_tokens=False)["input_ids"]
    through_tag = len(tokenizer("let me think about it</think>", add_special_tokens=False)["input_ids"])
    assert 0 < through_tag < len(ids)
    parser = R1()
    assert parser.reasoning_tokens(ids, True, tokenizer) == through_tag
    assert parser.reasoning_tokens(ids, False, tokenizer) == len(ids)  # unclosed: all of it
    assert parser.reasoning_tokens(ids, None, tokenizer) == 0


def test_reasoning_tokens_counted_from_ids_when_the_tags_are_single_tokens():
    tokenizer = build_tokenizer(320)
    tokenizer.add_tokens(list(TAGS[QWEN3]))
    end = tokenizer.convert_tokens_to_ids("</think>")
    ids = tokenizer("<think>ab cd</think>\n\nok", add_special_tokens=False)["input_ids"]
    assert end in ids
    assert QWEN3().reasoning_tokens(ids, True, tokenizer) == ids.index(end) + 1


def test_the_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; choose from deepseek_r1, qwen3, "
                                         "openai_gptoss"):
        get_reasoning_parser("nope")


def test_a_parser_registered_with_other_tags_splits_on_those(monkeypatch):
    tagged = Qwen3ReasoningParser.tagged(ReasoningTags("<reason>", "</reason>"))
    monkeypatch.setitem(REASONING_PARSERS, "reason", tagged)
    parser = get_reasoning_parser("reason")
    text = "<reason>a <think>b</think></reason>\n\nanswer"
    assert parser().extract(text) == ("a <think>b</think>", "answer")
    for pieces in splits(text):
        stream = parser().stream()
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == \
            ("a <think>b</think>", "answer"), pieces
    assert parser().extract("<think>a</think>b") == (None, "<think>a</think>b")  # not its tags: all content
    assert QWEN3().extract("<think>a</think>b") == ("a", "b")  # the registered qwen3 still splits on <think>
    tokenizer = build_tokenizer(320)
    assert parser.for_prompt(tokenizer("assistant\n<reason>\n")["input_ids"], tokenizer).prompt_opened is True
    assert parser.for_prompt(tokenizer("assistant\n<think>\n")["input_ids"], tokenizer).prompt_opened is None


def test_empty_reasoning_tags_are_refused():
    with pytest.raises(ValueError, match="reasoning tags must not be empty"):
        Qwen3ReasoningParser.tagged(ReasoningTags("", "</think>"))


# --- structured outputs after the reasoning
@pytest.fixture(scope="module")
def compiler():
    return tiny_grammar_compiler()


POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
JSON_FORMAT = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=POINT))


def reasoning_grammar(parser, opened=None, response_format=None, **outputs) -> str:
    structured = StructuredOutputs.model_validate(outputs) if outputs else None
    result = grammar(response_format, structured, reasoning=parser(opened))
    assert result.params.grammar is not None
    return result.params.grammar


@pytest.mark.parametrize("parser, opened, good, bad", [
    (R1, None, ['thinking {"x": "no"}...</think>\n\n{"x": 1}', '<think>a</think>{"x": -2}'],
     ['{"x": 1}', 'a</think>\n\n{"x": "1"}', 'a</think>\n\n{"x":1}', 'a</think>\n\n\n\n\n{"x": 1}']),
    (QWEN3, None, ['<think>\nhmm\n</think>\n\n{"x": 1}', '{"x": 1}'], ['hmm</think>{"x": 1}', '<think>a</think>{}']),
    (QWEN3, False, ['{"x": 1}'], ['<think>a</think>{"x": 1}']),
    (QWEN3, True, ['hmm</think>\n\n{"x": 1}'], ['{"x": 1}']),
])
def test_a_json_schema_applies_after_the_reasoning(compiler, parser, opened, good, bad):
    lark = reasoning_grammar(parser, opened, JSON_FORMAT)
    for text in good:
        assert accepts(compiler, lark, text), text
    for text in bad:
        assert not accepts(compiler, lark, text), text


def test_regex_choice_lark_and_json_object_apply_after_the_reasoning(compiler):
    cases = [(dict(regex=r"[a-c]{2}/[0-9]+"), "ab/12", "ab12"), (dict(choice=["yes", 'say "no"']), 'say "no"', "no"),
             (dict(grammar='start: "x" item+\nitem: "y" | "z"'), "xyzy", "x"),
             (dict(json_object=True), '{"k": [1]}', "1")]
    for outputs, good, bad in cases:
        lark = reasoning_grammar(R1, **outputs)
        assert accepts(compiler, lark, "hmm</think>" + good), outputs
        assert not accepts(compiler, lark, "hmm</think>" + bad), outputs


def test_a_strict_tool_call_applies_after_the_reasoning(compiler):
    hermes = get_tool_parser("hermes")()
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "strict": True,
                                                                   "parameters": WEATHER_PARAMS}})]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    r1 = grammar(None, None, tools, "auto", tool_parser=hermes, reasoning=R1()).params.grammar
    assert accepts(compiler, r1, "<think>a <tool_call> in the reasoning is text</think>\n\n" + call)
    assert not accepts(compiler, r1, "a</think>\n\n" + call.replace("Oslo", "Rome"))
    qwen3 = grammar(None, None, tools, "auto", tool_parser=hermes, reasoning=QWEN3()).params.grammar
    assert accepts(compiler, qwen3, "<think>a</think>\n\n" + call)
    assert accepts(compiler, qwen3, "no thinking, just text " + call)
    assert not accepts(compiler, qwen3, "<think>a</think>\n\n" + call.replace("Oslo", "Rome"))


# --- harmony (gpt-oss)
@pytest.mark.parametrize("tail, output, reasoning", [
    ("<|start|>user<|message|>Hi<|end|><|start|>assistant", "<|channel|>analysis<|message|>a<|end|>", "a"),
    ("<|start|>user<|message|>Hi<|end|>", "<|channel|>analysis<|message|>a<|end|>", "a"),
    ("<|start|>assistant<|channel|>final<|message|>", "a<|end|>", None)])
def test_a_harmony_prompt_decides_where_the_output_starts(tail, output, reasoning):
    tokenizer = build_tokenizer(320)  # harmony's markers in byte-sized tokens: decoded all the same
    parser = GPTOSS.for_prompt(tokenizer("<|start|>system<|message|>Be brief.<|end|>" + tail)["input_ids"], tokenizer)
    assert parser.extract(output)[0] == reasoning


def test_harmony_reasoning_tokens_run_through_the_first_end_marker():
    tokenizer = build_tokenizer(320)
    ids = tokenizer(THINKS + ANSWERS, add_special_tokens=False)["input_ids"]
    through_end = len(tokenizer(THINKS, add_special_tokens=False)["input_ids"])
    stream = GPTOSS(ASSISTANT).stream()
    stream.feed(THINKS + ANSWERS)
    stream.finish()
    assert 0 < GPTOSS().reasoning_tokens(ids, stream.ended, tokenizer) == through_end < len(ids)


def test_harmony_asks_for_its_special_tokens_and_refuses_structured_outputs():
    assert GPTOSS.needs_special_tokens and not QWEN3.needs_special_tokens
    with pytest.raises(OpenAIError, match="openai_gptoss .the harmony format. cannot be combined"):
        grammar(JSON_FORMAT, None, reasoning=GPTOSS(ASSISTANT))
    assert grammar(JSON_FORMAT, None, reasoning=QWEN3()) is not None  # the same request with <think> reasoning
