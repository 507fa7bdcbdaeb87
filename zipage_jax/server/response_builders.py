"""Engine outputs as the response bodies (responses.py) of /v1/completions and
/v1/chat/completions: whole responses and stream chunks."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from zipage_jax.engine.outputs import TokenLogprob
from zipage_jax.server.chat_output import ChatOutput, ChoiceDelta, ChoiceParser
from zipage_jax.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionTokenLogprob,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    FunctionCallDelta,
    MessageToolCall,
    PromptLogprob,
    PromptLogprobs,
    ResponseBody,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from zipage_jax.server.structured import new_tool_call_id, tool_call, tool_calls
from zipage_jax.server.tool_parsers import ToolCallPiece, whole_calls


class ResponseBuilder(ABC):
    """What the two endpoints share: ids, envelopes, prompt log-probabilities; subclasses shape a choice."""

    id_prefix: str
    object: str
    chunk_object: str
    response_model: type[Completion | ChatCompletion]
    chunk_model: type[CompletionChunk | ChatCompletionChunk]
    prompt_logprobs_in_choices: bool  # vLLM's place for them: each choice (completions) or the response (chat)

    def __init__(self, model: str, tokenizer: Any, request_id: str):
        self.id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self._tokenizer = tokenizer

    def response(self, choices: list[ResponseBody], usage: Usage) -> Completion | ChatCompletion:
        return self.response_model(id=self.id, object=self.object, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def chunk(self, choices: list[ResponseBody], usage: Usage | None = None,
              include_usage: bool = False) -> CompletionChunk | ChatCompletionChunk:
        # OpenAI: with include_usage every chunk carries "usage", null except in the last one
        given_usage = {"usage": usage} if include_usage else {}
        # built from values this builder made (a stream sends one per token): not validated again
        return self.chunk_model.model_construct(id=self.id, object=self.chunk_object, created=self.created,
                                                model=self.model, choices=choices, **given_usage)

    def opening_choices(self, num_choices: int) -> list[ResponseBody]:
        """Choices sent before any token (chat announces the assistant role)."""
        return []

    @abstractmethod
    def choice(self, index: int, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str,
               stop_reason: str | int | None) -> ResponseBody:
        """A whole response's choice."""

    @abstractmethod
    def stream_choices(self, index: int, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                       stop_reason: str | int | None, text_offset: int) -> list[ResponseBody]:
        """The chunk choices of what a choice added (`text`, `logprobs`), one chunk each, at
        least one: the first has the logprobs, the last the finish reason."""

    def reasoning_tokens(self, index: int, token_ids: list[int]) -> int | None:
        """How many of choice `index`'s tokens (once finished) are reasoning; None without a reasoning parser."""
        return None

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def prompt_logprobs(self, entries: list[TokenLogprob | None]) -> PromptLogprobs:
        """vLLM's prompt_logprobs: per prompt token None (the first) or the prompt token and its top
        alternatives by token id (rank None: the prompt token, below the top)."""
        out: PromptLogprobs = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            ranks = {t: r for r, (t, _) in enumerate(lp.top, 1)}
            tokens = {lp.token_id: lp.logprob, **dict(lp.top)}
            out.append({str(t): PromptLogprob(logprob=_finite(v), rank=ranks.get(t), decoded_token=self.token_text(t))
                        for t, v in tokens.items()})
        return out


class CompletionBuilder(ResponseBuilder):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"
    response_model, chunk_model = Completion, CompletionChunk
    prompt_logprobs_in_choices = True

    def choice(self, index, text, logprobs, finish_reason, stop_reason):
        return CompletionChoice(**self._fields(index, text, logprobs, finish_reason, stop_reason, 0))

    def stream_choices(self, index, text, logprobs, finish_reason, stop_reason, text_offset):
        fields = self._fields(index, text, logprobs, finish_reason, stop_reason, text_offset)
        return [CompletionChunkChoice.model_construct(**fields)]

    def _fields(self, index: int, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                stop_reason: str | int | None, text_offset: int) -> dict:
        shown = None if logprobs is None else self._logprobs(logprobs, text_offset)
        return dict(index=index, text=text, logprobs=shown, finish_reason=finish_reason, stop_reason=stop_reason)

    def _logprobs(self, logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(self.token_text(lp.token_id))
            offsets.append(text_offset)
            text_offset += len(tokens[-1])
        return CompletionLogprobs(tokens=tokens, token_logprobs=[_finite(lp.logprob) for lp in logprobs],
                                  top_logprobs=[({self.token_text(t): _finite(v) for t, v in lp.top} or None)
                                                if lp.logprob is not None else None for lp in logprobs],
                                  text_offset=offsets)


class ChatBuilder(ResponseBuilder):
    """Each choice's text goes through its ChoiceParser (chat_output.py): with a reasoning parser
    the reasoning becomes reasoning_content; with tool_choice "auto" the calls the tool parser
    finds become tool_calls (a stream sends each as it is written: a delta with its id and name
    once the name is known, then deltas with its arguments' next text), and finish_reason is
    "tool_calls" when there are any (as vLLM, also for a choice cut short by max_tokens after a
    call). With tool_choice "required" or a named function the content is the tool grammar's
    JSON and becomes tool_calls once the choice has ended; a stream sends them whole in the
    choice's last delta."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    response_model, chunk_model = ChatCompletion, ChatCompletionChunk
    prompt_logprobs_in_choices = False

    def __init__(self, model: str, tokenizer: Any, request_id: str, output: ChatOutput | None = None):
        super().__init__(model, tokenizer, request_id)
        self.output = output or ChatOutput()
        self._parsers: dict[int, ChoiceParser] = {}
        self._grammar_text: dict[int, str] = defaultdict(str)  # content so far per choice, in grammar tool mode
        self._calling: set[int] = set()  # the choices that sent a parsed call

    def opening_choices(self, num_choices: int) -> list[ResponseBody]:
        return [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                finish_reason=None) for i in range(num_choices)]

    def choice(self, index, text, logprobs, finish_reason, stop_reason):
        parser = self._parser(index)
        delta = parser.feed(text)
        delta += parser.finish()
        calls, content = [tool_call(call.name, call.arguments) for call in whole_calls(delta.calls)], delta.content
        if calls:
            finish_reason = "tool_calls"
        if self.output.grammar_tool_choice is not None:
            grammar_calls, finish_reason = self._grammar_calls(content, finish_reason)
            if grammar_calls is not None:
                calls, content = grammar_calls, ""
        message = self._reasoning_field(delta) | ({"tool_calls": calls} if calls else {})
        content = content or (None if calls or delta.reasoning else content)
        return ChatChoice(index=index, message=AssistantMessage(role="assistant", content=content, **message),
                          logprobs=self._chat_logprobs(logprobs), finish_reason=finish_reason, stop_reason=stop_reason)

    def stream_choices(self, index, text, logprobs, finish_reason, stop_reason, text_offset):
        parser = self._parser(index)
        delta = parser.feed(text)
        if finish_reason is not None:
            delta += parser.finish()
        grammar_mode = self.output.grammar_tool_choice is not None
        if grammar_mode:  # the content is the tool grammar's JSON, sent as calls once it has all come
            self._grammar_text[index] += delta.content
        fields = self._reasoning_field(delta, streaming=True)
        if delta.content and not grammar_mode:
            fields["content"] = delta.content
        deltas = ([ChatDelta(**fields)] if fields else []) + self._call_deltas(index, delta.calls)
        if finish_reason is not None and grammar_mode:
            last, finish_reason = self._grammar_delta(index, finish_reason)
            deltas.append(last)
        if finish_reason is not None and index in self._calling:
            finish_reason = "tool_calls"
        deltas = deltas or [ChatDelta()]
        end = len(deltas) - 1
        return [ChatChunkChoice(index=index, delta=d, logprobs=self._chat_logprobs(logprobs) if i == 0 else None,
                                finish_reason=finish_reason if i == end else None,
                                stop_reason=stop_reason if i == end else None) for i, d in enumerate(deltas)]

    def _call_deltas(self, index: int, pieces: list[ToolCallPiece]) -> list[ChatDelta]:
        """A delta per piece of a parsed call: the first with the call's id, type and name
        (arguments ""), the next ones with its arguments' next text."""
        if pieces:
            self._calling.add(index)
        entries = [ToolCallDelta(index=p.index, function=FunctionCallDelta(arguments=p.arguments)) if p.name is None
                   else ToolCallDelta(index=p.index, id=new_tool_call_id(), type="function",
                                      function=FunctionCallDelta(name=p.name, arguments="")) for p in pieces]
        return [ChatDelta(tool_calls=[entry]) for entry in entries]

    def _grammar_delta(self, index: int, finish_reason: str) -> tuple[ChatDelta, str]:
        """A grammar tool mode choice's last delta (its calls whole, or its text if it was cut
        short) and finish reason."""
        text = self._grammar_text.pop(index)
        calls, finish_reason = self._grammar_calls(text, finish_reason)
        if calls is None:
            return ChatDelta(content=text), finish_reason
        return ChatDelta(content=None, tool_calls=[
            ToolCallDelta(index=i, id=c.id, type=c.type, function=FunctionCallDelta(**c.function.model_dump()))
            for i, c in enumerate(calls)]), finish_reason

    def reasoning_tokens(self, index: int, token_ids: list[int]) -> int | None:
        reasoning = self.output.reasoning
        if reasoning is None:
            return None
        return reasoning.reasoning_tokens(token_ids, self._parser(index).reasoning_ended, self._tokenizer)

    def _parser(self, index: int) -> ChoiceParser:
        if index not in self._parsers:
            self._parsers[index] = self.output.choice_parser()
        return self._parsers[index]

    def _reasoning_field(self, delta: ChoiceDelta, streaming: bool = False) -> dict:
        """reasoning_content, when there is a reasoning parser (a stream's: when there is reasoning)."""
        if self.output.reasoning is None or (streaming and not delta.reasoning):
            return {}
        return {"reasoning_content": delta.reasoning or None}

    def _grammar_calls(self, text: str, finish_reason: str) -> tuple[list[MessageToolCall] | None, str]:
        """The calls of a completion the tool grammar made, and its finish reason: None (and the
        engine's reason) unless it ended complete; "tool_calls" for "required", "stop" for a named function."""
        calls = tool_calls(text, self.output.tool_choice) if finish_reason == "stop" else None
        if calls is None:
            return None, finish_reason
        return calls, "tool_calls" if self.output.tool_choice == "required" else "stop"

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        return None if logprobs is None else ChatLogprobs(content=[self._entry(lp) for lp in logprobs])

    def _entry(self, lp: TokenLogprob) -> ChatCompletionTokenLogprob:
        return ChatCompletionTokenLogprob(**self._token(lp.token_id, lp.logprob),
                                          top_logprobs=[TopLogprob(**self._token(t, v)) for t, v in lp.top])

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, -9999.0)  # as vLLM: JSON has no -inf
