"""Engine outputs as the response bodies (responses.py) of /v1/completions and
/v1/chat/completions: whole responses and stream chunks."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from zipage_jax.engine.outputs import TokenLogprob
from zipage_jax.server.protocol import ToolChoice
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
    PromptLogprob,
    PromptLogprobs,
    ResponseBody,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from zipage_jax.server.structured import tool_calls


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
        return self.chunk_model(id=self.id, object=self.chunk_object, created=self.created, model=self.model,
                                choices=choices, **given_usage)

    def opening_choices(self, num_choices: int) -> list[ResponseBody]:
        """Choices sent before any token (chat announces the assistant role)."""
        return []

    @abstractmethod
    def choice(self, index: int, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
               stop_reason: str | int | None, text_offset: int, streaming: bool) -> ResponseBody:
        """One choice: a whole response's, or a stream chunk's delta (`text` is then the delta)."""

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

    def choice(self, index, text, logprobs, finish_reason, stop_reason, text_offset, streaming):
        choice_model = CompletionChunkChoice if streaming else CompletionChoice
        return choice_model(index=index, text=text,
                            logprobs=None if logprobs is None else self._logprobs(logprobs, text_offset),
                            finish_reason=finish_reason, stop_reason=stop_reason)

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
    """With `tool_choice` ("required" or a named function) each completion is the tool grammar's
    JSON and becomes `tool_calls`; a stream sends them whole in the choice's last delta."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    response_model, chunk_model = ChatCompletion, ChatCompletionChunk
    prompt_logprobs_in_choices = False

    def __init__(self, model: str, tokenizer: Any, request_id: str, tool_choice: ToolChoice | None = None):
        super().__init__(model, tokenizer, request_id)
        self.tool_choice = tool_choice
        self._tool_text: dict[int, str] = defaultdict(str)  # streamed text per choice, in tool mode

    def opening_choices(self, num_choices: int) -> list[ResponseBody]:
        return [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                finish_reason=None) for i in range(num_choices)]

    def choice(self, index, text, logprobs, finish_reason, stop_reason, text_offset, streaming):
        if self.tool_choice is not None:
            message, finish_reason = self._tool_message(index, text, finish_reason, streaming)
        else:
            message = {"content": text} if text or not streaming else {}
        fields = dict(index=index, logprobs=None if logprobs is None else ChatLogprobs(
            content=[self._entry(lp) for lp in logprobs]), finish_reason=finish_reason, stop_reason=stop_reason)
        if streaming:
            return ChatChunkChoice(delta=ChatDelta(**message), **fields)
        return ChatChoice(message=AssistantMessage(role="assistant", **message), **fields)

    def _tool_message(self, index: int, text: str, finish_reason: str | None,
                      streaming: bool) -> tuple[dict, str | None]:
        """The fields of a tool-mode choice's message (or delta) and its finish reason: tool_calls
        once the whole completion is known, the raw text if it is not a complete call (cut by max_tokens)."""
        if streaming:
            self._tool_text[index] += text
            if finish_reason is None:
                return {}, None
            text = self._tool_text.pop(index)
        calls = tool_calls(text, self.tool_choice) if finish_reason == "stop" else None
        if calls is None:
            return {"content": text}, finish_reason
        if streaming:
            calls = [ToolCallDelta(index=i, id=call.id, type=call.type, function=call.function)
                     for i, call in enumerate(calls)]
        return {"content": None, "tool_calls": calls}, "tool_calls" if self.tool_choice == "required" else "stop"

    def _entry(self, lp: TokenLogprob) -> ChatCompletionTokenLogprob:
        return ChatCompletionTokenLogprob(**self._token(lp.token_id, lp.logprob),
                                          top_logprobs=[TopLogprob(**self._token(t, v)) for t, v in lp.top])

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, -9999.0)  # as vLLM: JSON has no -inf
