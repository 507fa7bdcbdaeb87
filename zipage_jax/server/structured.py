"""Structured outputs and tool calls: OpenAI's `response_format`, vLLM's `structured_outputs`
and `tools` / `tool_choice` become the engine's grammar (StructuredOutputsParams); a constrained
completion becomes `tool_calls`.

`tool_choice` (resolve_tool_choice): omitted, it is "auto" with tools and "none" without, as in
OpenAI's API and vLLM. "auto" needs the server's --enable-auto-tool-choice and
--tool-call-parser: the output is free and the parser finds the calls in it (tool_parsers/);
a tool with `strict: true` then constrains it to the parser's format of free text and calls,
each call's arguments following its tool's parameters. "required" constrains the output to a
JSON array of {"name", "parameters"} objects, one of the tools each; a named function to that
function's parameters. "none" leaves the tools in the prompt and the output unparsed.

With a reasoning parser, any grammar applies after the reasoning: the grammar lets the
reasoning come first (reasoning_parsers/), then up to four blanks, then the constrained answer.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import llguidance

from zipage_jax.sampling_params import StructuredOutputsParams
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import ResponseFormat, StructuredOutputs, Tool, ToolChoice
from zipage_jax.server.reasoning_parsers import ReasoningParser
from zipage_jax.server.responses import MessageFunctionCall, MessageToolCall
from zipage_jax.server.tool_parsers import ToolParser

# JSON inside a Lark grammar laid out as the engine lays out a JSON schema's output (json.dumps')
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class Grammar:
    params: StructuredOutputsParams
    param: str  # the request parameter it comes from, which errors name


def grammar(response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None,
            tools: list[Tool] | None = None, tool_choice: ToolChoice = "none", parallel_tool_calls: bool = True,
            tool_parser: ToolParser | None = None, reasoning: ReasoningParser | None = None) -> Grammar | None:
    """The engine's grammar for a request, or None; OpenAIError 400 naming the parameter.
    `tool_choice`: resolved (resolve_tool_choice); `tool_parser`: the server's, with "auto"."""
    given = [(name, fields) for name, fields in (
        ("response_format", _format_grammar(response_format)),
        ("structured_outputs", _outputs_grammar(structured_outputs)),
        ("tool_choice", _tool_choice_grammar(tools, tool_choice, parallel_tool_calls)),
        ("tools", _strict_tools_grammar(tools, tool_choice, tool_parser))) if fields is not None]
    if len(given) > 1:
        raise OpenAIError(400, f"{' and '.join(name for name, _ in given)} cannot be combined: each constrains the "
                          "output", param=given[1][0])
    if not given:
        return None
    param, fields = given[0]
    if reasoning is not None:
        fields = {"grammar": reasoning.grammar(_rule_body(fields, param))}
    return _params(fields, param)


def _outputs_grammar(structured_outputs: StructuredOutputs | None) -> dict | None:
    if structured_outputs is None:
        return None
    fields = structured_outputs.model_dump(by_alias=True, exclude_none=True)
    if fields.get("json_object") is False:
        del fields["json_object"]
    if len(fields) != 1:
        raise OpenAIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                          param="structured_outputs")
    return fields


def _tool_choice_grammar(tools: list[Tool] | None, tool_choice: ToolChoice, parallel: bool) -> dict | None:
    if tool_choice in ("none", "auto"):
        return None
    return {"json": tool_schema(tools, tool_choice, parallel)}


def _strict_tools_grammar(tools: list[Tool] | None, tool_choice: ToolChoice,
                          tool_parser: ToolParser | None) -> dict | None:
    """With "auto" and a strict tool: the parser's format, each call one of the tools, a strict
    one's arguments following its parameters (any other's any object)."""
    if tool_choice != "auto" or tool_parser is None or not any(t.function.strict for t in tools):
        return None
    key = tool_parser.arguments_key
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               key: _parameters(t) if t.function.strict else {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    return {"grammar": tool_parser.grammar({"anyOf": calls, "x-guidance": JSON_LAYOUT})}


def _rule_body(fields: dict, param: str) -> str:
    """The grammar `fields` describe as the body of a Lark rule."""
    if "grammar" in fields:
        return f"%lark {{\n{fields['grammar']}\n}}"
    if "regex" in fields:
        return f"/{llguidance.regex_to_lark(fields['regex'], '')}/"
    if "choice" in fields:
        return " | ".join(json.dumps(c) for c in fields["choice"])
    schema = {"type": "object"} if fields.get("json_object") else fields["json"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise OpenAIError(400, f"{param}: the schema is not JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise OpenAIError(400, f"{param}: the schema must be a JSON object", param=param)
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"


def _format_grammar(response_format: ResponseFormat | None) -> dict | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema")
    return {"json": response_format.json_schema.schema_}


def _params(fields: dict, param: str) -> Grammar:
    try:
        return Grammar(StructuredOutputsParams(**fields), param)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from exc


def resolve_tool_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None, auto_enabled: bool) -> ToolChoice:
    """The request's tool choice, its default filled in ("auto" with tools, else "none");
    OpenAIError 400 for one the tools or the server cannot serve."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return tool_choice
    if not tools:
        raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise OpenAIError(400, f'{AUTO_NEEDS_FLAGS} (or use tool_choice "required", "none" or a named function)',
                          param="tool_choice")
    if tool_choice in ("auto", "required"):
        return tool_choice
    names = [t.function.name for t in tools]
    if tool_choice.function.name not in names:
        raise OpenAIError(400, f"tool_choice names {tool_choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    return tool_choice


def tool_schema(tools: list[Tool], tool_choice: ToolChoice, parallel: bool = True) -> dict:
    """The JSON schema of the output: the named function's parameters, or for "required" an
    array of calls of the tools (one, unless `parallel`)."""
    if tool_choice != "required":
        return _parameters(next(t for t in tools if t.function.name == tool_choice.function.name))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_calls(text: str, tool_choice: ToolChoice) -> list[MessageToolCall] | None:
    """OpenAI's tool_calls for a completion the tool grammar produced (None if it is not JSON:
    the output was cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if tool_choice == "required":
        calls = [(call["name"], call["parameters"]) for call in value]
    else:
        calls = [(tool_choice.function.name, value)]
    return [tool_call(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]


def tool_call(name: str, arguments: str) -> MessageToolCall:
    """OpenAI's tool call of function `name` with `arguments` (JSON text), under a new id."""
    return MessageToolCall(id=new_tool_call_id(), type="function",
                           function=MessageFunctionCall(name=name, arguments=arguments))


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template receives them (transformers' `tools=`)."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]
