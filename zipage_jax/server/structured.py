"""Structured outputs and tool calls: OpenAI's `response_format`, vLLM's `structured_outputs`
and `tools` / `tool_choice` become the engine's grammar (StructuredOutputsParams); a constrained
completion becomes `tool_calls`.

Tool calls go through the same grammar: `tool_choice` "required" constrains the output to a JSON
array of {"name", "parameters"} objects, one of the tools each; a named function to that
function's parameters. "auto" is refused, since no chat template here defines a tool-call
format the server could parse out of free text.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from zipage_jax.sampling_params import StructuredOutputsParams
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.protocol import FunctionCall, ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolChoice


@dataclass(frozen=True)
class Grammar:
    params: StructuredOutputsParams
    param: str  # the request parameter it comes from, which errors name


def grammar(response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None,
            tools: list[Tool] | None = None, tool_choice: ToolChoice | None = None,
            parallel_tool_calls: bool = True) -> Grammar | None:
    """The engine's grammar for a request, or None; OpenAIError 400 naming the parameter."""
    given = [name for name, value in (("response_format", _format_grammar(response_format)),
                                      ("structured_outputs", structured_outputs),
                                      ("tool_choice", _tool_function(tools, tool_choice))) if value is not None]
    if len(given) > 1:
        raise OpenAIError(400, f"{' and '.join(given)} cannot be combined: each constrains the output", param=given[1])
    if structured_outputs is not None:
        fields = structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        if len(fields) != 1:
            raise OpenAIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                              param="structured_outputs")
        return _params(fields, "structured_outputs")
    if given == ["response_format"]:
        return _params(_format_grammar(response_format), "response_format")
    if given == ["tool_choice"]:
        return _params({"json": tool_schema(tools, tool_choice, parallel_tool_calls)}, "tool_choice")
    return None


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


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice | None:
    """`tool_choice` when the tools constrain the output ("required" or a named function)."""
    return None if _tool_function(tools, tool_choice) is None else tool_choice


def _tool_function(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> str | None:
    """"required" or the named function's name when tools constrain the output, else None."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
    if tool_choice == "auto":
        raise OpenAIError(400, 'tool_choice "auto" is not supported (this server cannot parse tool calls out of '
                          'free text); use "required" or a named function', param="tool_choice")
    if tool_choice == "required":
        return "required"
    names = [t.function.name for t in tools]
    if tool_choice.function.name not in names:
        raise OpenAIError(400, f"tool_choice names {tool_choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    return tool_choice.function.name


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


def tool_calls(text: str, tool_choice: ToolChoice) -> list[ToolCall] | None:
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
    return [ToolCall(id=f"call_{secrets.token_hex(12)}", type="function",
                     function=FunctionCall(name=name, arguments=json.dumps(arguments))) for name, arguments in calls]


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template receives them (transformers' `tools=`)."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]
