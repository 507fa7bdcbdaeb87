"""OutputSink: where one HTTP request's outputs wait for its handler, merged while they wait.

The engine's outputs arrive at the pace of its steps; a handler that falls behind (a slow client,
a busy event loop) would otherwise see one output per step queue up. Instead an output joins the
one of the same request still waiting, unless an error came after it (its deltas appended, its
cumulative fields replaced), as vLLM's output collector does: a stream then carries several
tokens per chunk when it lags, and the work per chunk does not pile up.
"""

from __future__ import annotations

import asyncio
import dataclasses

from zipage_jax.engine.outputs import CompletionOutput, RequestOutput


class OutputSink:
    def __init__(self) -> None:
        self._items: list[object] = []  # RequestOutputs (at most one per request id) and errors, in order
        self._waiting: dict[str, int] = {}  # request id -> its output's index in _items
        self._ready = asyncio.Event()

    def put_nowait(self, item: object) -> None:
        """On the event loop: a RequestOutput (merged into its request's waiting one) or an error."""
        if isinstance(item, RequestOutput):
            at = self._waiting.get(item.request_id)
            if at is not None:
                self._items[at] = merge(self._items[at], item)
                return
            self._waiting[item.request_id] = len(self._items)
        else:
            self._waiting = {}  # nothing merges ahead of an error
        self._items.append(item)
        self._ready.set()

    async def get(self) -> object:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.pop(0)
        self._waiting = {rid: i - 1 for rid, i in self._waiting.items() if i > 0}
        return item


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output for both: the deltas of both in order, everything else the newer's."""
    outputs = [_merge_completion(a, b) for a, b in zip(older.outputs, newer.outputs)]
    prompt_logprobs = newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs
    return dataclasses.replace(newer, outputs=outputs, prompt_logprobs=prompt_logprobs)


def _merge_completion(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = None if a.delta_logprobs is None and b.delta_logprobs is None else \
        (a.delta_logprobs or []) + (b.delta_logprobs or [])
    return dataclasses.replace(b, delta_text=a.delta_text + b.delta_text,
                               delta_token_ids=a.delta_token_ids + b.delta_token_ids, delta_logprobs=logprobs)
