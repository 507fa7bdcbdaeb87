"""`bench soak`'s client: Poisson arrivals of the mix's requests under a concurrency cap, each
request sent with httpx and recorded as a Record (soak_checks.py judges them), and the replica
kill at its time.

Arrivals come at --rate per second on average (exponential gaps from the seeded generator); an
arrival that finds --concurrency requests in flight waits for one to end, and its request's
time starts when it is sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx

from zipage_jax.bench.soak_checks import STREAM_ERROR, Record, body_problem
from zipage_jax.bench.soak_mix import Mix, Planned

REQUEST_TIMEOUT_S = 300.0


class Traffic:
    """Sends the mix's requests to `url`; every request's Record lands in `records`. Times are
    seconds since `origin` (time.monotonic()), the measured run's start."""

    def __init__(self, url: str, mix: Mix, concurrency: int, origin: float):
        self.url, self.mix, self.origin = url, mix, origin
        self.concurrency = concurrency
        self.records: list[Record] = []

    def now(self) -> float:
        return time.monotonic() - self.origin

    def restart_clock(self) -> None:
        """Times from now on count from now; the records so far move back (negative times)."""
        shift = self.now()
        self.origin += shift
        for record in self.records:
            record.sent -= shift
            record.ended -= shift

    async def sequential(self, planned: list[Planned], phase: str) -> None:
        """Each request in turn (the warm-up's first pass: every kind once, nothing else in flight)."""
        async with self._client() as client:
            for p in planned:
                await self._send(client, p, phase)

    async def poisson(self, start: float, end: float, rate: float, seed: int, phase: str,
                      at: tuple[float, Callable[[], None]] | None = None) -> None:
        """Arrivals from `start` to `end` (seconds since the origin) at `rate` per second, then
        waits for every request in flight; `at`: (time, fn) runs fn() (in a thread) at that time."""
        rng = random.Random(seed)
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        timed = None if at is None else asyncio.create_task(self._at(*at))
        async with self._client() as client:
            t = start
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                await asyncio.sleep(max(0.0, t - self.now()))
                planned = self.mix.next()
                await slots.acquire()
                if self.now() >= end:
                    slots.release()
                    break
                task = asyncio.create_task(self._send(client, planned, phase))
                tasks.add(task)
                task.add_done_callback(lambda done: (tasks.discard(done), slots.release()))
            await asyncio.gather(*tasks)
        if timed is not None:
            await timed

    async def _at(self, when: float, fn: Callable[[], None]) -> None:
        await asyncio.sleep(max(0.0, when - self.now()))
        await asyncio.to_thread(fn)

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=self.concurrency + 4))

    async def _send(self, client: httpx.AsyncClient, p: Planned, phase: str) -> None:
        record = Record(p.kind, phase, p.stream, p.expect, p.replayable, self.now(), greedy_case=p.greedy_case)
        try:
            if p.stream:
                await self._stream(client, p, record)
            else:
                await self._whole(client, p, record)
        except httpx.HTTPError as exc:
            record.problem = f"{type(exc).__name__}: {exc}"[:300]
        record.ended = self.now()
        self.records.append(record)

    async def _whole(self, client: httpx.AsyncClient, p: Planned, record: Record) -> None:
        r = await client.post(p.path, content=p.body, headers={"content-type": "application/json"})
        record.status = r.status_code
        if r.status_code != p.expect:
            record.problem = r.text[:300]
            return
        body = r.json()
        if p.expect != 200:
            if not isinstance(body.get("error"), dict):
                record.problem = f"a refusal without an OpenAI error body: {r.text[:200]}"
            return
        record.problem = body_problem(p.kind, body, p.n)
        if p.greedy_case is not None and record.problem is None:
            record.tokens = body["choices"][0]["logprobs"]["tokens"]

    async def _stream(self, client: httpx.AsyncClient, p: Planned, record: Record) -> None:
        events, done = 0, False
        async with client.stream("POST", p.path, content=p.body, headers={"content-type": "application/json"}) as r:
            record.status = r.status_code
            if r.status_code != 200:
                record.problem = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if "error" in json.loads(line.removeprefix("data: ")):
                    record.problem = STREAM_ERROR
                    return
                events += 1
                if p.disconnect_after is not None and events >= p.disconnect_after:
                    record.disconnected = True
                    return  # leaving the block closes the connection mid-stream
        if not done:
            record.problem = "the stream ended without [DONE]"
