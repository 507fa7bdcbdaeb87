"""What a chat completion's text is made of: reasoning (with --reasoning-parser), then content
and tool calls (tool_choice "auto", with --enable-auto-tool-choice and --tool-call-parser).
Tool calls are read from the content after the reasoning only. Each choice has its own parsing
state (ChoiceParser), fed its text as it streams, or whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zipage_jax.server.protocol import Tool, ToolChoice
from zipage_jax.server.reasoning_parsers import ReasoningDelta, ReasoningParser, ReasoningStream, get_reasoning_parser
from zipage_jax.server.structured import resolve_tool_choice
from zipage_jax.server.tool_parsers import TOOL_PARSERS, ToolCallPiece, ToolCallStream, ToolParser, get_tool_parser


@dataclass(frozen=True)
class ChatParsing:
    """The server's output parsers."""

    tool_parser: ToolParser | None = None  # set with --enable-auto-tool-choice only
    reasoning_parser: type[ReasoningParser] | None = None

    @classmethod
    def from_options(cls, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                     reasoning_parser: str | None = None) -> ChatParsing:
        """ValueError for an unknown parser, or --enable-auto-tool-choice without --tool-call-parser."""
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of: {', '.join(TOOL_PARSERS)})")
        tool_parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)()
        return cls(tool_parser if enable_auto_tool_choice else None,
                   None if reasoning_parser is None else get_reasoning_parser(reasoning_parser))

    def for_request(self, tools: list[Tool] | None, tool_choice: ToolChoice | None, prompt_token_ids: list[int],
                    tokenizer: Any) -> ChatOutput:
        """The output format of a request with these tools and prompt; OpenAIError 400 for a tool
        choice that cannot be served."""
        choice = resolve_tool_choice(tools, tool_choice, auto_enabled=self.tool_parser is not None)
        reasoning = (None if self.reasoning_parser is None
                     else self.reasoning_parser.for_prompt(prompt_token_ids, tokenizer))
        return ChatOutput(choice, self.tool_parser if choice == "auto" else None, reasoning)


@dataclass(frozen=True)
class ChatOutput:
    """One request's output format."""

    tool_choice: ToolChoice = "none"  # resolved
    tool_parser: ToolParser | None = None  # with tool_choice "auto"
    reasoning: ReasoningParser | None = None

    @property
    def grammar_tool_choice(self) -> ToolChoice | None:
        """"required" or a named function: the content is the tool grammar's JSON."""
        return None if self.tool_choice in ("none", "auto") else self.tool_choice

    def choice_parser(self) -> ChoiceParser:
        return ChoiceParser(None if self.reasoning is None else self.reasoning.stream(),
                            None if self.tool_parser is None else self.tool_parser.stream())


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallPiece] = field(default_factory=list)

    def __iadd__(self, other: ChoiceDelta) -> ChoiceDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ChoiceParser:
    """One choice's text split into reasoning, content and calls as it arrives."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self._reasoning, self._tools = reasoning, tools

    def feed(self, text: str) -> ChoiceDelta:
        """What the choice's next `text` made certain."""
        return self._split(ReasoningDelta(content=text) if self._reasoning is None else self._reasoning.feed(text),
                           final=False)

    def finish(self) -> ChoiceDelta:
        """What was held back, once the choice has ended."""
        return self._split(ReasoningDelta() if self._reasoning is None else self._reasoning.finish(), final=True)

    @property
    def reasoning_ended(self) -> bool | None:
        """None: no reasoning; False: reasoning not closed; True: closed."""
        return None if self._reasoning is None else self._reasoning.ended

    def _split(self, delta: ReasoningDelta, final: bool) -> ChoiceDelta:
        if self._tools is None:
            return ChoiceDelta(delta.reasoning, delta.content)
        tools = self._tools.feed(delta.content)
        if final:
            tools += self._tools.finish()
        return ChoiceDelta(delta.reasoning, tools.content, tools.calls)
