"""FormatThread: the one thread that formats outputs whose token texts must be decoded (the
tokens and up to 20 alternatives per token of log-probabilities), which would otherwise hold
the event loop for as long as it takes. It is the only user of the tokenizer that the response
formats are given (EngineClient.tokenizer), so that tokenizer is never shared between threads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class FormatThread:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zipage-format")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
