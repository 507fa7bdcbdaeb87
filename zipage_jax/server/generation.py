"""One HTTP request's generation: an engine request per prompt, answered whole or as SSE."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from zipage_jax.engine.outputs import RequestOutput, TokenLogprob
from zipage_jax.sampling_params import SamplingParams
from zipage_jax.server.engine_client import EngineClient, RequestFailed
from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.format_thread import FormatThread
from zipage_jax.server.output_sink import OutputSink
from zipage_jax.server.queue_capacity import Reservation
from zipage_jax.server.response_builders import ResponseBuilder
from zipage_jax.server.responses import KVCacheUsage, ResponseBody, Usage
from zipage_jax.server.shutdown import ServerShuttingDown


@dataclass(frozen=True)
class Echo:
    """Completions' echo: each choice's text (and logprobs) start with its prompt's; with
    `prompt_only` (max_tokens 0) they are only the prompt's."""

    texts: list[str]  # per prompt
    prompt_only: bool = False


@dataclass
class _Stream:
    """What a stream has sent so far, per choice."""

    started: set[int] = field(default_factory=set)
    sent_text: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    generated: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # tokens
    finished: set[int] = field(default_factory=set)


class Generation:
    """Choice p * n + i is completion i of prompt p (OpenAI's order). Engine request ids are the
    response id followed by the prompt's index. The request's place in the admission queue is
    released prompt by prompt as each starts, and wholly once the generation ends.

    A request with log-probabilities is formatted on the FormatThread (each token's text and its
    alternatives' are decoded); any other output is a small body, made on the event loop, where
    handing it to a thread would cost more."""

    def __init__(self, client: EngineClient, prompts: list[list[int]], params: SamplingParams,
                 builder: ResponseBuilder, request_id: str, reservation: Reservation, format_thread: FormatThread,
                 echo: Echo | None = None, stream: bool = True, stream_interval: int = 1):
        """`stream`: the response is streamed, a chunk per `stream_interval` tokens (else the engine
        sends only each prompt's first and final outputs)."""
        self.prompts, self.params, self.builder, self.request_id, self.echo = prompts, params, builder, request_id, echo
        self.stream, self.stream_interval = stream, stream_interval
        self._client = client
        self._reservation = reservation
        decodes = params.logprobs is not None or params.prompt_logprobs is not None
        self._format_thread = format_thread if decodes else None
        self._prompt_index = {f"{builder.id}-{p}": p for p in range(len(prompts))}
        self._unfinished: set[str] = set()
        self._outputs = OutputSink()
        self._latest: dict[int, RequestOutput] = {}
        self._prompt_logprobs: dict[int, list] = {}  # per prompt, once its prefill has finished

    async def start(self) -> None:
        """Adds every prompt; on an error (the engine's ValueError for bad input) aborts them all."""
        self._unfinished.update(self._prompt_index)
        added = [self._client.add(prompt, self.params, request_id, self._outputs, self.stream, self.stream_interval)
                 for request_id, prompt in zip(self._prompt_index, self.prompts)]
        try:
            results = await asyncio.gather(*added, return_exceptions=True)
        except BaseException:
            self.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort()
            raise errors[0]

    def abort(self) -> None:
        """Aborts what has not finished (idempotent; the engine frees its blocks)."""
        for request_id in self._unfinished:
            self._client.abort(request_id)
        self._unfinished.clear()
        self._reservation.release_all()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine advances; raises RequestFailed if the engine
        failed one of the prompts (abort() then ends the others)."""
        while self._unfinished:
            item = await self._outputs.get()
            if isinstance(item, RequestFailed):
                self._unfinished.clear()  # the engine client has aborted them
                raise item
            if item.error is not None:
                self._unfinished.discard(item.request_id)
                raise RequestFailed(item.error)
            if item.finished:
                self._unfinished.discard(item.request_id)
            prompt = self._prompt_index[item.request_id]
            if prompt not in self._latest:  # it has started: its sequences no longer wait
                self._reservation.release(self.params.n)
            self._latest[prompt] = item
            if item.prompt_logprobs is not None:
                self._prompt_logprobs[prompt] = item.prompt_logprobs
            yield prompt, item

    def usage(self) -> Usage:
        generated = 0 if self._prompt_only else sum(len(o.token_ids) for out in self._latest.values()
                                                    for o in out.outputs)
        # a prompt's cache hit is its first completion's (the others share that completion's blocks)
        cached = sum(out.outputs[0].metrics.get("cached_prompt_tokens", 0) for out in self._latest.values())
        reasoning = [self.builder.reasoning_tokens(p * self.params.n + o.index, o.token_ids)
                     for p, out in self._latest.items() for o in out.outputs]
        finished = [o.metrics for out in self._latest.values() for o in out.outputs if o.finish_reason is not None]
        kv_cache = None if not finished or len(finished) < len(self.prompts) * self.params.n else KVCacheUsage(
            kv_blocks_peak=max(m["kv_blocks_peak"] for m in finished),
            kv_budget_tokens=max(m["kv_budget_tokens"] for m in finished))
        return Usage.of(sum(map(len, self.prompts)), generated, cached,
                        sum(reasoning) if reasoning and None not in reasoning else None, kv_cache)

    async def response(self) -> JSONResponse:
        async for _ in self.outputs():
            pass
        return await self._formatted(self._response)

    async def _formatted(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args) if self._format_thread is None else await self._format_thread.run(fn, *args)

    def _response(self) -> JSONResponse:
        n = self.params.n
        choices = []
        for p, out in sorted(self._latest.items()):
            for o in out.outputs:
                text, logprobs = self._shown(p, o.text, o.logprobs, first=True)
                choice = self.builder.choice(p * n + o.index, text, logprobs, o.finish_reason, o.stop_reason)
                if self.builder.prompt_logprobs_in_choices:
                    self._with_prompt_logprobs(p, choice)
                choices.append(choice)
        response = self.builder.response(choices, self.usage())
        if not self.builder.prompt_logprobs_in_choices:  # chat: one prompt
            self._with_prompt_logprobs(0, response)
        return JSONResponse(response.body())  # rendered here, off the event loop when formatted off it

    @property
    def _prompt_only(self) -> bool:
        return self.echo is not None and self.echo.prompt_only

    def _shown(self, p: int, text: str, logprobs: list[TokenLogprob] | None,
               first: bool) -> tuple[str, list[TokenLogprob] | None]:
        """A choice's text and logprobs (or a stream's delta of them) as the client sees them:
        the prompt's in front of the first (echo), the generated ones dropped (prompt_only)."""
        if self._prompt_only:
            text, logprobs = "", None if logprobs is None else []
        if self.echo is None or not first:
            return text, logprobs
        if logprobs is not None:
            entries = self._prompt_logprobs.get(p) or [None] * len(self.prompts[p])
            prompt = [TokenLogprob(t, None, []) if lp is None else lp for t, lp in zip(self.prompts[p], entries)]
            logprobs = prompt + logprobs
        return self.echo.texts[p] + text, logprobs

    def _with_prompt_logprobs(self, p: int, body: ResponseBody) -> None:
        """vLLM's prompt_logprobs of prompt p in `body` (a choice, or a chat response), when asked for."""
        if self.params.prompt_logprobs is not None:
            body.prompt_logprobs = self.builder.prompt_logprobs(self._prompt_logprobs.get(p, []))

    async def events(self, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """SSE lines: a chunk (or more, see builder.stream_choices) per choice that advanced,
        [usage chunk], data: [DONE]. With `continuous_usage` (and include_usage) each chunk
        carries its choice's usage so far, as vLLM's continuous_usage_stats."""
        stream = _Stream()
        try:
            opening = self.builder.opening_choices(len(self.prompts) * self.params.n)
            if opening:
                so_far = Usage.of(sum(map(len, self.prompts)), 0) if continuous_usage else None
                yield _sse(self.builder.chunk(opening, so_far, include_usage=include_usage).body())
            async for p, out in self.outputs():
                events = await self._formatted(self._stream_events, stream, p, out, include_usage, continuous_usage)
                if events:
                    yield events
            if include_usage:
                yield _sse(self.builder.chunk([], self.usage(), include_usage=True).body())
        except RequestFailed as exc:
            yield _sse(failure_error(exc, self.request_id).body())
        yield "data: [DONE]\n\n"

    def _stream_events(self, stream: _Stream, p: int, out: RequestOutput, include_usage: bool,
                       continuous_usage: bool) -> str:
        """The SSE events of prompt p's latest output: a chunk per choice that advanced."""
        builder, n = self.builder, self.params.n
        events = []
        for o in out.outputs:
            index = p * n + o.index
            if index in stream.finished or not (o.delta_token_ids or o.delta_text or o.finish_reason):
                continue
            first = index not in stream.started
            stream.started.add(index)
            text, logprobs = self._shown(p, o.delta_text, o.delta_logprobs, first)
            choices = builder.stream_choices(index, text, logprobs, o.finish_reason, o.stop_reason,
                                             text_offset=stream.sent_text[index])
            if first:
                self._with_prompt_logprobs(p, choices[0])
            stream.sent_text[index] += len(text)
            stream.generated[index] += 0 if self._prompt_only else len(o.delta_token_ids)
            if o.finish_reason is not None:
                stream.finished.add(index)
            so_far = Usage.of(len(self.prompts[p]), stream.generated[index]) if continuous_usage else None
            events += [_sse(builder.chunk([choice], so_far, include_usage=include_usage).body()) for choice in choices]
        return "".join(events)


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends (finished, disconnected, failed),
    even if the body iterator never started."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def failure_error(exc: RequestFailed, request_id: str) -> OpenAIError:
    """What the client is told of its failed request: a 503 when the server aborted it to shut down,
    else a 500 naming the request id (the log says why)."""
    if isinstance(exc, ServerShuttingDown):
        return OpenAIError(503, str(exc))
    return OpenAIError.internal(request_id)


async def until_disconnected(request: Request, work: asyncio.Future | asyncio.Task) -> object | None:
    """The result of `work`, or None (work cancelled) if the client disconnects first."""
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work.done() else None
    finally:
        watcher.cancel()
        work.cancel()  # a no-op once done


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
