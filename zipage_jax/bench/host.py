"""The host's work per engine step as the batch grows, against the bare model step.

    zipage-jax bench host [--batches 16 64 256 1024] [--prompt-len 64] [--new-tokens 128]
        [--budget 64] [--block-size 16] [--runs 3] [--streams 256] [--skip-server] [--json] [--out PATH]

On `random-qwen3-tiny` (random weights, 2 layers, hidden 64: its device time is small, so the
host's share of a step shows), B requests of a --prompt-len-token prompt each generate
--new-tokens greedy tokens, with full KV and with a --budget-token KV budget (compacted every
block), in two engine cores sharing the model (EngineCore: what the server's engine process
runs; the output stage is the API process's). Per batch and engine: the median wall time of a
decode step (`core.step()`, no prefill in it) and the median of its host work
(`core.last_step_host_seconds`: the step less its wait for the device). In the same run, the
bare model step (bare_step.py: forward and sampling over the same B rows, no engine) is the
floor. The three are run in turns, --runs times, and every figure is a median over all runs.

Unless --skip-server: `zipage-jax serve` with the same model and options, --streams concurrent
streamed completions of the same workload, tokens/s against `LLM.generate` of the same prompts
in this process (host_server.py).

The goals (GOALS) are checked on the figures of one run; the JSON has every figure, each goal
with its value and whether it is met, and the run record. Exit status 0 whatever the goals.
"""

from __future__ import annotations

import argparse
import statistics

from zipage_jax.bench.host_goals import evaluate_goals
from zipage_jax.harness import add_output_arguments, emit, log

MODEL = "random-qwen3-tiny"
DECODE_SHARE = 0.8  # a step counts as a decode step of the batch when this share of it decoded


def engine_options(batch: int, args: argparse.Namespace, compressed: bool) -> dict:
    """The engine of one batch: every request runs at once, and a compressed one compacts in the
    step it fills its budget (max_compress_seqs = the batch)."""
    bs = args.block_size
    blocks = -(-(args.prompt_len + args.new_tokens) // bs)
    options = dict(kvcache_block_size=bs, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
                   num_kvcache_blocks=batch * blocks + 1, max_model_len=args.prompt_len + args.new_tokens,
                   max_compress_seqs=batch, query_cache_len=min(16, bs))
    if compressed:
        options["max_cache_blocks_per_seq"] = -(-args.budget // bs)
    return options


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no prefix-cache hits between requests)."""
    import numpy as np

    rng = np.random.default_rng(batch)
    return [[int(t) for t in rng.integers(1, vocab, prompt_len)] for _ in range(batch)]


class EngineRun:
    """One engine stepped through the workload: the wall and host seconds of its decode steps."""

    def __init__(self, engine, batch_prompts: list[list[int]], new_tokens: int):
        self.engine, self.prompts, self.new_tokens = engine, batch_prompts, new_tokens

    def run(self) -> tuple[list[float], list[float], int]:
        """(decode steps' wall seconds, their host seconds, programs compiled during the run)."""
        import time

        from zipage_jax import SamplingParams

        engine = self.engine
        params = SamplingParams(temperature=0, max_tokens=self.new_tokens, ignore_eos=True)
        compiles = engine.get_stats().num_compiles
        engine.add_requests([(p, params, None) for p in self.prompts])
        walls, hosts = [], []
        batch = len(self.prompts)
        while engine.has_unfinished_requests():
            s = engine.stats
            prefill, decode = s.prefill_tokens, s.decode_tokens
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            # a decode step of (almost) the whole batch read back: no prefill in it, every request
            # admitted, and at most the rows compacting this step missing
            if s.prefill_tokens == prefill and s.decode_tokens - decode >= DECODE_SHARE * batch:
                walls.append(wall)
                hosts.append(engine.last_step_host_seconds)
        return walls, hosts, engine.get_stats().num_compiles - compiles


def bench_batch(loaded, batch: int, args: argparse.Namespace) -> dict:
    from zipage_jax.bench.bare_step import BareStep
    from zipage_jax.engine.core import EngineCore

    batch_prompts = prompts(batch, args.prompt_len, loaded.config.vocab_size)
    runs = {name: EngineRun(EngineCore(loaded=loaded, model=MODEL, **engine_options(batch, args, name == "compressed")),
                            batch_prompts, args.new_tokens)
            for name in ("full", "compressed")}
    bare = BareStep(loaded, batch, args.prompt_len, args.new_tokens, args.block_size)
    bare.run()  # compiles
    for run in runs.values():  # compiles what the workload needs
        run.run()
    walls = {name: [] for name in runs}
    hosts = {name: [] for name in runs}
    compiles = {name: 0 for name in runs}
    bare_times: list[float] = []
    for _ in range(args.runs):
        bare_times += bare.run()
        for name, run in runs.items():
            w, h, c = run.run()
            walls[name] += w
            hosts[name] += h
            compiles[name] += c
    row = {"bare_step_ms": 1e3 * statistics.median(bare_times)}
    for name in runs:
        row[name] = {"step_ms": 1e3 * statistics.median(walls[name]), "host_ms": 1e3 * statistics.median(hosts[name]),
                     "host_ms_mean": 1e3 * statistics.fmean(hosts[name]), "decode_steps": len(walls[name]),
                     "compiles_while_timed": compiles[name]}
        row[name]["step_over_bare"] = row[name]["step_ms"] / row["bare_step_ms"]
    row["compressed_over_full_host"] = row["compressed"]["host_ms"] / row["full"]["host_ms"]
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 1024],
                        help="requests running at once (the first is the base of the host-time ratios)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--budget", type=int, default=64, help="the compressed engine's KV budget in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each engine and of the bare step")
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams of the server run")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the server's --stream-interval (tokens per streamed chunk; its default: 1)")
    parser.add_argument("--skip-server", action="store_true", help="no server run")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from zipage_jax.models.loading import load_model

    loaded = load_model(MODEL)
    result: dict = {"model": MODEL, "workload": {k: getattr(args, k) for k in (
        "batches", "prompt_len", "new_tokens", "budget", "block_size", "runs", "streams", "stream_interval")},
                    "batches": {}}
    for batch in args.batches:
        row = bench_batch(loaded, batch, args)
        result["batches"][str(batch)] = row
        log(f"batch {batch:5d}: bare {row['bare_step_ms']:.2f} ms; " + "; ".join(
            f"{name} step {row[name]['step_ms']:.2f} ms, host {row[name]['host_ms']:.2f} ms"
            for name in ("full", "compressed")))
    if not args.skip_server:
        from zipage_jax.bench.host_server import bench_server

        result["server"] = bench_server(loaded, args)
        log(f"server: {result['server']['server_tok_s']:.0f} tok/s, offline {result['server']['offline_tok_s']:.0f} "
            f"tok/s ({args.streams} streams)")
    result["goals"] = evaluate_goals(result)
    for name, goal in result["goals"].items():
        log(f"goal {name}: {goal['value']} ({goal['bound']}) {'met' if goal['met'] else 'MISSED'}")
    return emit(result, args)
