"""`bench host`'s server run: `zipage-jax serve` in its own process against `LLM.generate` in this
one, the same prompts and options, in turns.

The server's run is --streams concurrent streamed completions (token-id prompts, greedy,
ignore_eos, usage in the last chunk), timed from the first request sent to the last stream's
end. The client is a load generator that shares the server's cores, so it does as little as a
client can: raw HTTP/1.1 over asyncio streams, each response read whole as it arrives and only
its usage chunk parsed (a real client on another machine would cost this one nothing). Both
sides run once untimed first (compiling what the workload needs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from zipage_jax.harness import log

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

    with serving(options, ["--stream-interval", str(args.stream_interval)]) as base_url:
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
    return {"streams": args.streams, "stream_interval": args.stream_interval, "offline_tok_s": result["offline"],
            "server_tok_s": result["server"],
            "server_over_offline": result["server"] / result["offline"],
            "seconds": {name: [round(s, 3) for s in t] for name, t in times.items()}}


def _flags(options: dict) -> list[str]:
    return [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


@contextlib.contextmanager
def serving(options: dict, flags: list[str] = ()) -> Iterator[str]:
    """`zipage-jax serve` of the bench model with engine `options` and server `flags` on a free
    loopback port, once /health is 200; stopped (SIGTERM) on exit. Its log goes to a temporary
    file, shown if it fails."""
    import httpx

    from zipage_jax.bench.host import MODEL

    port = _free_port()
    command = [sys.executable, "-m", "zipage_jax", "serve", "--model", MODEL, "--port", str(port), "--no-warmup",
               "--log-level", "warning", *_flags(options), *flags]
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
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    counts = await asyncio.gather(*(_stream(host, int(port), p, max_tokens) for p in batch_prompts))
    return sum(counts)


async def _stream(host: str, port: int, prompt: list[int], max_tokens: int) -> int:
    """One streamed completion's tokens, from its usage chunk (RuntimeError unless a 200 that ends
    with [DONE])."""
    body = json.dumps({"model": "random-qwen3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    response = await reader.read()  # until the server closes the connection
    writer.close()
    head, _, events = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in events:
        raise RuntimeError(f"a stream failed: {response[:300]!r}")
    usage = events.rfind(b'"completion_tokens": ')
    return int(events[usage + 21:].split(b",", 1)[0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
