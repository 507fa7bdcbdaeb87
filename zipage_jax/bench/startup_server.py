"""`zipage-jax bench startup`'s client of a starting server: /health until it answers 200, then
concurrent streaming completions (their time to first token) while /metrics is polled until the
warm-up grid is built."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

from zipage_jax.bench.startup_metrics import grid_done, parse_metrics, server_metric_snapshot, stream_summary


class ServerProbe:
    """`streams` concurrent streams of `stream_tokens` tokens each, everything given up `timeout`
    seconds after the start."""

    def __init__(self, streams: int, stream_tokens: int, timeout: float):
        self.streams, self.stream_tokens, self.timeout = streams, stream_tokens, timeout

    async def session(self, proc: subprocess.Popen, url: str, t0: float) -> dict:
        """Waits for /health 200, then sends the streams at once while polling /metrics for the
        warm-up grid; every time in seconds since `t0`, the server process's start."""
        import httpx

        deadline = time.monotonic() + self.timeout
        limits = httpx.Limits(max_connections=self.streams + 8, max_keepalive_connections=self.streams + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10.0), limits=limits) as client:
            health_s = None
            while health_s is None:
                if proc.poll() is not None:
                    return {"error": f"the server exited with status {proc.returncode} before /health 200"}
                if time.monotonic() > deadline:
                    return {"error": f"no /health 200 within {self.timeout} s"}
                try:
                    if (await client.get(f"{url}/health", timeout=5.0)).status_code == 200:
                        health_s = time.time() - t0
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            poller = asyncio.create_task(self.poll_grid(client, url, t0, deadline))
            streams = await asyncio.gather(*(self.bounded_stream(client, url, i, deadline)
                                             for i in range(self.streams)))
            streams_done_s = time.time() - t0
            grid = await poller
            # the counters come from the engine thread's last stats snapshot, which may lag the grid's gauges
            grid["metrics"] = await self.final_metrics(client, url, grid["metrics"])
        summary = stream_summary(streams)
        return {"ok": True, "health_s": health_s, **summary, "streams_done_at_s": streams_done_s, **grid}

    async def final_metrics(self, client, url: str, fallback: dict) -> dict:
        """/metrics once the streams are done (the engine thread has refreshed its stats since)."""
        import httpx

        try:
            resp = await client.get(f"{url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return fallback
        return server_metric_snapshot(parse_metrics(resp.text)) if resp.status_code == 200 else fallback

    async def poll_grid(self, client, url: str, t0: float, deadline: float, give_up_s: float = 5.0) -> dict:
        """Scrapes /metrics until the grid is built, the metrics say there is no grid (for `give_up_s`), or the
        deadline."""
        import httpx

        last, unknown_since = None, time.monotonic()
        while time.monotonic() < deadline:
            try:
                resp = await client.get(f"{url}/metrics", timeout=10.0)
                if resp.status_code == 200:
                    last = parse_metrics(resp.text)
            except httpx.HTTPError:
                pass
            done = grid_done(last)
            if done:
                return {"grid_done_s": time.time() - t0, "grid_done_from": "metrics",
                        "metrics": server_metric_snapshot(last)}
            if done is None and time.monotonic() - unknown_since > give_up_s:
                return {"grid_done_s": None, "grid_done_from": None, "metrics": server_metric_snapshot(last),
                        "grid_note": "no warm-up grid in /metrics (this server has no background warm-up, or none ran)"}
            if done is not None:
                unknown_since = time.monotonic()
            await asyncio.sleep(0.25)
        return {"grid_done_s": None, "grid_done_from": None, "metrics": server_metric_snapshot(last),
                "grid_note": f"the grid was not built within {self.timeout} s of the start"}

    async def bounded_stream(self, client, url: str, i: int, deadline: float) -> dict:
        """One stream, given up at the deadline (httpx's timeouts bound each read, not the whole stream)."""
        try:
            return await asyncio.wait_for(self.stream(client, url, i), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return {"ok": False, "ttft_s": None, "seconds": None, "chunks": None,
                    "error": f"not finished within {self.timeout:g} s of the start"}

    async def stream(self, client, url: str, i: int) -> dict:
        """One streaming /v1/completions request (a prompt of its own): its TTFT and how it ended."""
        import httpx

        body = {"model": "bench", "prompt": f"Request {i}: name one fact about the number {i + 7}.",
                "max_tokens": self.stream_tokens, "temperature": 0, "stream": True}
        start = time.perf_counter()
        first_chunk = first_text = None
        chunks, done, error = 0, False, None
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            error = f"stream error: {str(event['error'])[:200]}"
                            continue
                        choices = event.get("choices") or []
                        if choices:
                            chunks += 1
                            now = time.perf_counter() - start
                            first_chunk = now if first_chunk is None else first_chunk
                            if first_text is None and any(c.get("text") for c in choices):
                                first_text = now
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        ttft = first_text if first_text is not None else first_chunk
        if error is None and not done:
            error = "the stream ended without [DONE]"
        return {"ok": error is None and ttft is not None, "ttft_s": ttft, "seconds": time.perf_counter() - start,
                "chunks": chunks, "error": error}
