"""`bench host`'s server run: `zipage-jax serve` in its own process against `LLM.generate` in this
one, the same prompts and options, in turns.

The server's run is --streams concurrent streamed completions (token-id prompts, greedy,
ignore_eos, usage in the last chunk), timed from the first request sent to the last stream's
end; the client reads each stream's lines and parses only its usage chunk, so the client costs
the machine little beside the server. Both sides run once untimed first (compiling what the
workload needs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from zipage_jax.bench.common import log

HEALTH_TIMEOUT_S = 600.0


def bench_server(loaded, args: argparse.Namespace) -> dict:
    from zipage_jax import SamplingParams
    from zipage_jax.bench.host import MODEL, engine_options, prompts
    from zipage_jax.llm import LLM

    options = engine_options(args.streams, args, compressed=False)
    batch_prompts = prompts(args.streams, args.prompt_len, loaded.config.vocab_size)
    expected = args.streams * args.new_tokens
    llm = LLM(MODEL, loaded=loaded, **options)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def offline() -> float:
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        got = sum(len(o["token_ids"]) for o in outs)
        if got != expected:
            raise RuntimeError(f"LLM.generate gave {got} tokens, expected {expected}")
        return seconds

    with serving(options) as base_url:
        def online() -> float:
            start = time.perf_counter()
            got = asyncio.run(_streams(base_url, batch_prompts, args.new_tokens))
            seconds = time.perf_counter() - start
            if got != expected:
                raise RuntimeError(f"the server's streams gave {got} tokens, expected {expected}")
            return seconds

        offline()
        online()
        times: dict[str, list[float]] = {"offline": [], "server": []}
        for _ in range(args.runs):
            times["offline"].append(offline())
            times["server"].append(online())
    result = {name: expected / statistics.median(t) for name, t in times.items()}
    return {"streams": args.streams, "offline_tok_s": result["offline"], "server_tok_s": result["server"],
            "server_over_offline": result["server"] / result["offline"],
            "seconds": {name: [round(s, 3) for s in t] for name, t in times.items()}}


def _flags(options: dict) -> list[str]:
    return [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


@contextlib.contextmanager
def serving(options: dict) -> Iterator[str]:
    """`zipage-jax serve` of the bench model with `options` on a free loopback port, once /health
    is 200; stopped (SIGTERM) on exit. Its log goes to a temporary file, shown if it fails."""
    import httpx

    from zipage_jax.bench.host import MODEL

    port = _free_port()
    command = [sys.executable, "-m", "zipage_jax", "serve", "--model", MODEL, "--port", str(port), "--no-warmup",
               "--log-level", "warning", *_flags(options)]
    with tempfile.TemporaryFile("w+") as server_log:
        proc = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, env=os.environ.copy())
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while True:
                if proc.poll() is not None:
                    server_log.seek(0)
                    raise RuntimeError(f"the server exited with status {proc.returncode}:\n{server_log.read()[-4000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not become healthy in time")
                time.sleep(0.5)
            log(f"server ready on {base_url}")
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _streams(base_url: str, batch_prompts: list[list[int]], max_tokens: int) -> int:
    """Completion tokens of all the streams, run at once."""
    import httpx

    limits = httpx.Limits(max_connections=len(batch_prompts), max_keepalive_connections=len(batch_prompts))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        counts = await asyncio.gather(*(_stream(client, p, max_tokens) for p in batch_prompts))
    return sum(counts)


async def _stream(client, prompt: list[int], max_tokens: int) -> int:
    import json

    body = {"model": "random-qwen3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"completion_tokens"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
