"""Throughput at equal KV memory: full KV vs Zipage compression, in one process.

    zipage-jax bench throughput [--quick] [--json] [--out PATH] [--requests 32] [--max-tokens 512]
        [--prompt-len 32 256] [--sequential] [--model default] [engine options, e.g. --max-cache-blocks-per-seq 4]
    zipage-jax bench throughput --quick --json --budgets 2 4 8 --policies zipage window   # sweep
    zipage-jax bench throughput --quick --json --kv-cache-dtype int8   # + quantized pools, same bytes

One workload (long greedy generations with `ignore_eos`, mixed prompt lengths cut from the
standard library's argparse.py) and one KV pool (`--num-kvcache-blocks`, the same for both
runs) are run twice in one process: with full KV, and with compression to
`--max-cache-blocks-per-seq` blocks under the recommended scoring (global score + pooling +
lightning redundancy). The pool defaults to what compression needs to hold every request at
once, so full KV holds only a few and preempts or queues the rest.

The two engines are stepped in turns of 16 steps, the one with fewer tokens so far next, and
each is timed over its own steps only, a turn ending with a wait for the engine's dispatched
work (asynchronous scheduling would otherwise leave it running during the other engine's
turn): both finish together and see the same load on a shared machine (`--sequential` runs
full KV, then Zipage). Each engine first compiles every program its
configuration can reach (`LLMEngine.warmup`, untimed); the engine counts its compiles, and
any compile in the timed run (`compiles_in_timed_run`, 0 after a warm-up) is left out of the
step times and of the compaction time (`--no-warmup` compiles on first use instead, its time
left out the same way). Compactions are timed by blocking on each (the engine option `profile_compaction`), so
they never overlap the host's work.

Pool sizing is explicit in the output: `pool` gives the KV dtype, bytes per block (K and V of
every layer, plus the scales of a quantized pool: `LLMEngine.pool.block_bytes`), blocks (the dummy
block 0 included) and usable bytes. `--kvcache-memory-gb G` sizes the pool in bytes instead of
blocks, as the engine does (G GiB / bytes per block, plus the dummy block).

`--kv-cache-dtype int8` (or `fp8`, or `int4`) adds quantized pools of the SAME BYTES as the
default dtype's: about 2x the blocks against bfloat16, about 4x against float32 (CPU), less the
scales (int4, packed two values a byte with a float16 scale per 32: 3.6x and 7.1x at head_dim
64). Full KV and Zipage then run at both dtypes, all four engines interleaved, and the JSON
gains "kv_cache_dtype_comparison": per dtype its pool (blocks, bytes per block), tokens/s and
concurrency (mean / peak running) side by side, and the quantized / default ratios.

The default preset is 32 concurrent long generations (20-30 minutes on a 2-core CPU,
a few on a GPU); `--quick` is a scaled-down one (6 requests, about 4 minutes on 2 busy cores
once its programs are in the executable store; the first run on a machine compiles them). The last line of `--json`
is one JSON object: throughput_full, throughput_zipage, speedup, compress_time_share, the
per-run figures under "full" / "zipage" (every run under "runs"), the pool and the workload.
Each run also says where its steps went: `tokens_per_step`, `steps_queued` (steps after which a
request still waited for the pool) with the sequences running and the pool's share in use in
them, `mean_kv_usage`, and `kv_tokens_held_per_output_token` (the pool's tokens held, summed over
the steps, per token generated). Zipage's tokens per step over full KV's is exactly
`kv_held_per_token_ratio` (memory held per token, full over Zipage: the speedup if both kept the
pool full) times `kv_usage_ratio` (how full each kept it, Zipage over full).

Sweep (`--budgets M1 M2 ...` and/or `--policies P1 P2 ...`): full KV once and compression with
every (policy, budget) pair, all on one pool sized for the LARGEST budget
(`requests * (max M + 1) + 1` blocks unless `--num-kvcache-blocks` is given), so every point
uses the same KV bytes; the policy replaces `eviction_policy` in the recommended scoring, the
rest of the scoring is the same for every policy. All the engines are stepped in turn as above.
The JSON then holds a "sweep" list, one row per point (policy, budget_blocks, budget_tokens,
budget_fraction = budget / mean final request length, throughput, mean/peak running,
preemptions, compressions, compress_time_share, speedup vs full KV, and throughput_vs_zipage
when zipage ran at the same budget); `zipage-jax bench plot` plots it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace

import numpy as np

from zipage_jax.bench.stepping import EngineRun, drive, warm_up
from zipage_jax.bench.task_table import run_task_table
from zipage_jax.bench.workload import (
    RECOMMENDED_SCORING,
    Pool,
    Workload,
    add_workload_arguments,
    engine_config,
    make_prompts,
    size_pools,
    workload_overrides,
)
from zipage_jax.compress.auto_budget import parse_budget
from zipage_jax.harness import add_output_arguments, emit, log, usage_error

PRESETS = {
    # 32 concurrent long generations; full KV holds about 4 of them at once
    "default": Workload(requests=32, prompt_len_min=32, prompt_len_max=256, max_tokens=512, block_size=16,
                        budget_blocks=4),
    # a few minutes on a 2-core CPU; full KV holds about one request at once
    "quick": Workload(requests=6, prompt_len_min=16, prompt_len_max=48, max_tokens=208, block_size=16,
                      budget_blocks=2),
}


class TimedRun(EngineRun):
    """One engine working through the workload, one step at a time, timing only its own steps
    (less the compile time inside them) and sampling its stats after each."""

    def __init__(self, name: str, engine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True):
        from zipage_jax import SamplingParams

        super().__init__(name, engine)
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.ids = [engine.add_request(p, params, stream=False) for p in prompts]
        self.finished: dict[str, dict] = {}
        self.running: list[int] = []  # per step: sequences running, requests waiting, share of the pool held
        self.waiting: list[int] = []
        self.kv_usage: list[float] = []
        self.seconds = 0.0
        self.compile_seconds = 0.0
        self.compress_compile_seconds = 0.0

    def step(self) -> None:
        engine = self.engine
        before, before_compress = engine.get_stats().compile_seconds, engine.introspect().compaction_compile_seconds
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        compiled = engine.get_stats().compile_seconds - before
        self.compile_seconds += compiled
        self.compress_compile_seconds += engine.introspect().compaction_compile_seconds - before_compress
        self.seconds += max(0.0, elapsed - compiled)
        for out in outputs:
            if out.finished:
                self.finished[out.request_id] = out.to_dict()
        stats = self.engine.get_stats()
        self.running.append(stats.num_running)
        self.waiting.append(stats.num_waiting)
        self.kv_usage.append(stats.kv_usage)

    def end_turn(self) -> None:
        self.seconds += self.wait_for_device()

    def results(self) -> list[dict]:
        results = [self.finished[i] for i in self.ids]
        lengths = {len(r["token_ids"]) for r in results}
        if self.ignore_eos and lengths != {self.max_tokens}:
            raise RuntimeError(f"{self.name}: expected {self.max_tokens} tokens per request with ignore_eos, "
                               f"got lengths {sorted(lengths)}")
        return results


def summarize(run: TimedRun, warm: dict) -> dict:
    engine, results = run.engine, run.results()
    stats, inside = engine.get_stats(), engine.introspect()
    if stats.num_free_blocks != stats.num_kv_blocks:
        raise RuntimeError(f"{run.name}: KV blocks leaked after the run")
    compress_seconds = max(0.0, inside.compaction_seconds - run.compress_compile_seconds)
    output_tokens = sum(len(r["token_ids"]) for r in results)
    config = engine.config
    compressed = config.max_cache_blocks_per_seq is not None
    running, usage = np.array(run.running), np.array(run.kv_usage)
    queued = np.array(run.waiting) > 0
    pool_tokens = (config.num_kvcache_blocks - 1) * config.kvcache_block_size
    return {
        "throughput": output_tokens / run.seconds,
        "output_tokens": output_tokens,
        "wall_seconds": run.seconds,
        "compile_seconds_excluded": run.compile_seconds,
        "compiles_in_timed_run": run.num_compiles,
        **warm,
        "steps": len(run.running),
        "mean_running": float(running.mean()),
        "peak_running": int(running.max()),
        "tokens_per_step": output_tokens / len(run.running),
        # the steps after which a request still waited for the pool, and what ran in them
        "steps_queued": int(queued.sum()),
        "mean_running_queued": float(running[queued].mean()) if queued.any() else None,
        "mean_kv_usage": float(usage.mean()),
        "mean_kv_usage_queued": float(usage[queued].mean()) if queued.any() else None,
        # pool tokens held per step, summed over the run, per token generated: memory x time per token
        "kv_tokens_held_per_output_token": float(usage.sum()) * pool_tokens / output_tokens,
        "preemptions": stats.num_preemptions,
        "compressions": stats.num_compressions,
        "kv_tokens_evicted": stats.kv_tokens_evicted,
        "compress_seconds": compress_seconds,
        "compress_time_share": compress_seconds / run.seconds,
        "prefill_tokens": stats.prefill_tokens,
        "kv_blocks_peak_max": max(r["metrics"]["kv_blocks_peak"] for r in results),
        "query_slots": stats.num_query_slots if compressed else None,
        "kv_cache_dtype": config.kv_cache_dtype,
        "pool_blocks": config.num_kvcache_blocks,
        "block_bytes": inside.kv_block_bytes,
        "pool_bytes": (config.num_kvcache_blocks - 1) * inside.kv_block_bytes,
    }


def bench_modes(loaded, configs: dict, prompts: list[list[int]], max_tokens: int, interleave: bool = True,
                log=None, warmup: bool = True, ignore_eos: bool = True, answers: dict | None = None
                ) -> dict[str, dict]:
    """The named engine configs on fresh engines sharing the loaded model, each warmed up, then
    all timed on the same prompts. `answers`, when given, receives each run's outputs by name."""
    from zipage_jax.engine.llm_engine import LLMEngine

    runs, warm = [], {}
    for name, config in configs.items():
        engine = LLMEngine(replace(config, profile_compaction=True), loaded=loaded)
        warm[name] = warm_up(engine, warmup)
        runs.append(TimedRun(name, engine, prompts, max_tokens, ignore_eos))
    drive(runs, interleave)
    rows = {run.name: summarize(run, warm[run.name]) for run in runs}
    if answers is not None:
        answers.update({run.name: run.results() for run in runs})
    for name, row in rows.items():
        if log:
            log(f"{name:>12}: {row['throughput']:.1f} tok/s, running mean {row['mean_running']:.1f} peak "
                f"{row['peak_running']}, preemptions {row['preemptions']}, compressions {row['compressions']}, "
                f"compress share {100 * row['compress_time_share']:.1f}%, {row['tokens_per_step']:.1f} tokens a step, "
                f"KV usage {100 * row['mean_kv_usage']:.0f}%, {row['kv_tokens_held_per_output_token']:.0f} KV "
                f"tokens held a step per token, {row['steps_queued']} of {row['steps']} steps with a request waiting, "
                f"{row['wall_seconds']:.1f}s "
                f"({row['compiles_in_timed_run']} compiles, +{row['compile_seconds_excluded']:.1f}s excluded; "
                f"{row['warmup_seconds']:.1f}s warm-up)")
    return rows


def _check_pool(name: str, row: dict, pool: Pool) -> None:
    if (row["pool_blocks"], row["block_bytes"]) != (pool.blocks, pool.block_bytes):
        raise RuntimeError(f"{name}: the engine's pool ({row['pool_blocks']} blocks of {row['block_bytes']} bytes) "
                           f"is not the one sized here ({pool.blocks} of {pool.block_bytes})")


def pair_summary(full: dict, zipage: dict, pool: Pool, mean_len: float) -> dict:
    """Full KV against Zipage on one pool."""
    return {
        "throughput_full": full["throughput"],
        "throughput_zipage": zipage["throughput"],
        "speedup": zipage["throughput"] / full["throughput"],
        "compress_time_share": zipage["compress_time_share"],
        "mean_running_full": full["mean_running"],
        "mean_running_zipage": zipage["mean_running"],
        "peak_running_full": full["peak_running"],
        "peak_running_zipage": zipage["peak_running"],
        "preemptions_full": full["preemptions"],
        "preemptions_zipage": zipage["preemptions"],
        # tokens per step, Zipage over full KV, is exactly the product of these two: the pool held per
        # token generated (full KV over Zipage) and the share of the pool in use (Zipage over full KV)
        "kv_held_per_token_ratio": full["kv_tokens_held_per_output_token"] / zipage["kv_tokens_held_per_output_token"],
        "kv_usage_ratio": zipage["mean_kv_usage"] / full["mean_kv_usage"],
        "pool": pool.as_dict(),
        "pool_blocks": pool.blocks,
        "pool_tokens": pool.tokens,
        "full_kv_capacity_seqs": pool.tokens / mean_len,  # requests of mean final length the pool holds
    }


def run_benchmark(workload: Workload, model: str = "default", options: dict | None = None, loaded=None,
                  interleave: bool = True, log=None, warmup: bool = True) -> dict:
    """Full KV and Zipage on the same workload and pool (and, with options["kv_cache_dtype"]
    quantized, both again on a pool of that dtype and the same bytes). Returns the summary dict."""
    from zipage_jax.models.loading import load_model

    options = dict(options or {})
    quantized = options.pop("kv_cache_dtype", "auto")
    options.pop("kvcache_memory_gb", None)  # in the workload (pool_gb)
    workload.check()
    loaded = loaded or load_model(model, dtype=options.get("dtype"), revision=options.get("revision"),
                                   download_dir=options.get("download_dir"))
    dtypes = ["auto"] + ([quantized] if quantized != "auto" else [])
    pools = size_pools(workload, loaded, dtypes, options.get("tensor_parallel_size", 1))
    prompts = make_prompts(loaded.tokenizer, workload)
    mean_len = float(np.mean([len(p) for p in prompts])) + workload.max_tokens
    suffix = {d: "" if d == "auto" else f"-{d}" for d in dtypes}  # run names: full, zipage, full-int8, ...
    configs = {f"{mode}{suffix[d]}": engine_config(model, workload, mode == "zipage", options, pools[d])
               for d in dtypes for mode in ("full", "zipage")}
    rows = bench_modes(loaded, configs, prompts, workload.max_tokens, interleave, log, warmup)
    pairs = {}
    for d in dtypes:
        for mode in ("full", "zipage"):
            _check_pool(f"{mode}{suffix[d]}", rows[f"{mode}{suffix[d]}"], pools[d])
        pairs[d] = pair_summary(rows[f"full{suffix[d]}"], rows[f"zipage{suffix[d]}"], pools[d], mean_len)
    summary = {
        **pairs["auto"],
        "budget_tokens": workload.budget_blocks * workload.block_size,
        "model": str(loaded.source),
        "scoring": RECOMMENDED_SCORING,
        "options": options,
        "interleaved": interleave,
        "warmup": warmup,
        "workload": asdict(workload),
        "full": rows["full"],
        "zipage": rows["zipage"],
        "runs": rows,
    }
    if quantized != "auto":
        summary["kv_cache_dtype_comparison"] = dtype_comparison(pairs, quantized)
    return summary


def dtype_comparison(pairs: dict[str, dict], quantized: str) -> dict:
    """The default dtype against the quantized one, on pools of the same bytes."""
    base, quant = pairs["auto"], pairs[quantized]

    def ratio(key: str) -> float:
        return quant[key] / base[key]

    return {
        "pool_bytes": base["pool"]["bytes"],
        "dtypes": {d: {k: v for k, v in pair.items() if k not in ("pool_blocks", "pool_tokens")}
                   for d, pair in pairs.items()},
        "blocks_ratio": (quant["pool"]["blocks"] - 1) / (base["pool"]["blocks"] - 1),
        "throughput_ratio_full": ratio("throughput_full"),
        "throughput_ratio_zipage": ratio("throughput_zipage"),
        "mean_running_ratio_full": ratio("mean_running_full"),
        "mean_running_ratio_zipage": ratio("mean_running_zipage"),
    }


def format_dtype_comparison(comparison: dict) -> str:
    """The dtype comparison as a Markdown table."""
    lines = ["| KV dtype | bytes / block | blocks | full tok/s | zipage tok/s | mean / peak running full "
             "| mean / peak running zipage | preemptions full / zipage |", "|---|---|---|---|---|---|---|---|"]
    for d, row in comparison["dtypes"].items():
        pool = row["pool"]
        lines.append(f"| {d} ({pool['kv_dtype']}) | {pool['block_bytes']} | {pool['blocks']} | "
                     f"{row['throughput_full']:.1f} | {row['throughput_zipage']:.1f} | "
                     f"{row['mean_running_full']:.2f} / {row['peak_running_full']} | "
                     f"{row['mean_running_zipage']:.2f} / {row['peak_running_zipage']} | "
                     f"{row['preemptions_full']} / {row['preemptions_zipage']} |")
    return "\n".join(lines)


def sweep_workload(workload: Workload, budgets: list[int]) -> Workload:
    """The workload with its pool fixed for the largest budget (unless given) and that budget."""
    largest = max(budgets)
    if workload.pool_blocks or workload.pool_gb:
        return replace(workload, budget_blocks=largest)
    return replace(workload, budget_blocks=largest, pool_blocks=workload.requests * (largest + 1) + 1)


def pool_note(workload: Workload, budgets: list[int], pool: Pool) -> str:
    """How the sweep's one pool was chosen (workload before `sweep_workload`)."""
    origin = "as given" if workload.pool_blocks or workload.pool_gb else \
        f"sized for the largest budget, {max(budgets)} blocks"
    return (f"one pool of {pool.blocks} blocks of {pool.block_size} tokens, {pool.block_bytes} bytes each "
            f"({origin}) for full KV and every point: the same KV bytes everywhere")


def run_sweep(workload: Workload, budgets: list[int], policies: list[str], model: str = "default",
              options: dict | None = None, loaded=None, interleave: bool = True, log=None,
              warmup: bool = True) -> dict:
    """Full KV once and every (policy, budget) on one pool (sized for the largest budget unless given)."""
    from zipage_jax.models.loading import load_model

    if not budgets or not policies or min(budgets) < 1:
        raise ValueError("a sweep needs budgets >= 1 and at least one policy")
    options = {k: v for k, v in (options or {}).items() if k not in ("eviction_policy", "kvcache_memory_gb")}
    if options.pop("kv_cache_dtype", "auto") != "auto":
        raise ValueError("a sweep runs at the default KV dtype; compare dtypes without --budgets / --policies")
    budgets = sorted(set(budgets))
    swept = sweep_workload(workload, budgets)
    swept.check()
    loaded = loaded or load_model(model, dtype=options.get("dtype"), revision=options.get("revision"),
                                   download_dir=options.get("download_dir"))
    pool = size_pools(swept, loaded, ["auto"], options.get("tensor_parallel_size", 1))["auto"]
    prompts = make_prompts(loaded.tokenizer, swept)
    mean_len = float(np.mean([len(p) for p in prompts])) + swept.max_tokens
    points = {f"{policy}@{m}": (policy, m) for policy in dict.fromkeys(policies) for m in budgets}
    configs = {"full": engine_config(model, swept, False, options, pool)}
    configs.update({name: engine_config(model, replace(swept, budget_blocks=m), True,
                                        {**options, "eviction_policy": policy}, pool)
                    for name, (policy, m) in points.items()})
    rows = bench_modes(loaded, configs, prompts, swept.max_tokens, interleave, log, warmup)
    full = rows["full"]
    sweep = []
    for name, (policy, m) in points.items():
        row = rows[name]
        sweep.append({
            "policy": policy,
            "budget_blocks": m,
            "budget_tokens": m * workload.block_size,
            "budget_fraction": m * workload.block_size / mean_len,
            "throughput": row["throughput"],
            "mean_running": row["mean_running"],
            "peak_running": row["peak_running"],
            "preemptions": row["preemptions"],
            "compressions": row["compressions"],
            "compress_time_share": row["compress_time_share"],
            "speedup": row["throughput"] / full["throughput"],
        })
    for point in sweep:
        ref = rows.get(f"zipage@{point['budget_blocks']}")
        if ref is not None:
            point["throughput_vs_zipage"] = point["throughput"] / ref["throughput"]
    return {
        "sweep": sweep,
        "throughput_full": full["throughput"],
        "mean_running_full": full["mean_running"],
        "peak_running_full": full["peak_running"],
        "preemptions_full": full["preemptions"],
        "budgets": budgets,
        "policies": list(dict.fromkeys(policies)),
        "pool": pool.as_dict(),
        "pool_blocks": pool.blocks,
        "pool_tokens": pool.tokens,
        "pool_note": pool_note(workload, budgets, pool),
        "mean_final_len": mean_len,
        "full_kv_capacity_seqs": pool.tokens / mean_len,
        "model": str(loaded.source),
        "scoring": {k: v for k, v in RECOMMENDED_SCORING.items() if k != "eviction_policy"},
        "options": options,
        "interleaved": interleave,
        "warmup": warmup,
        "workload": asdict(swept),
        "runs": rows,
    }


def format_sweep(summary: dict) -> str:
    """The sweep as a Markdown table (full KV first)."""
    lines = ["| policy | budget (blocks / tokens / of context) | tok/s | mean / peak running | preemptions "
             "| compress share | speedup vs full | vs zipage |", "|---|---|---|---|---|---|---|---|",
             f"| full KV | - | {summary['throughput_full']:.1f} | {summary['mean_running_full']:.2f} / "
             f"{summary['peak_running_full']} | {summary['preemptions_full']} | 0 | 1.00x | |"]
    for p in summary["sweep"]:
        vs = f"{p['throughput_vs_zipage']:.3f}" if "throughput_vs_zipage" in p else ""
        lines.append(f"| {p['policy']} | {p['budget_blocks']} / {p['budget_tokens']} / "
                     f"{100 * p['budget_fraction']:.0f}% | {p['throughput']:.1f} | {p['mean_running']:.2f} / "
                     f"{p['peak_running']} | {p['preemptions']} | {100 * p['compress_time_share']:.1f}% "
                     f"| {p['speedup']:.2f}x | {vs} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zipage_jax.cli_options import add_engine_arguments
    from zipage_jax.compress.policies import POLICIES

    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    add_workload_arguments(parser, "the scaled-down preset (a few minutes on a CPU)")
    add_output_arguments(parser)
    parser.add_argument("--sequential", action="store_true",
                        help="run full KV, then Zipage (default: interleave their steps, see above)")
    parser.add_argument("--budgets", type=int, nargs="+", metavar="M",
                        help="sweep: compressed budgets in blocks (max_cache_blocks_per_seq values)")
    parser.add_argument("--policies", nargs="+", metavar="POLICY", choices=list(POLICIES),
                        help=f"sweep: eviction policies, of {', '.join(POLICIES)} (default: zipage vnorm-prompt)")
    for task, what in (("humaneval", "HumanEval's"), ("gsm8k", "GSM8K's")):
        parser.add_argument(f"--{task}", choices=("dev", "heldout"),
                            help=f"the paper's table on {what} chat prompts of this split: full KV against the "
                                 "default policy at --task-budget, throughput and pass ratio from one run")
    parser.add_argument("--task-budget", type=parse_budget, default=128,
                        help="--humaneval / --gsm8k: the compressed run's kv_budget, tokens or auto")
    parser.add_argument("--pool-budget", type=int, default=128,
                        help="--task-budget auto: the pool holds every request at this many tokens")
    parser.add_argument("--limit", type=int, help="--humaneval / --gsm8k: at most this many problems")
    # engine options: --model, --kvcache-block-size, --num-kvcache-blocks, --max-cache-blocks-per-seq, ...;
    # --no-warmup compiles on first use instead of before timing (that compile time is left out too)
    add_engine_arguments(parser)


def settings(args: argparse.Namespace) -> tuple[Workload, str, dict]:
    """The workload, the model and the other engine options of the flags (warmup among them:
    done here, timed apart, not by the engine); a usage error for flags that do not go together."""
    from zipage_jax.cli_options import engine_options

    if args.budgets and args.max_cache_blocks_per_seq is not None:
        usage_error("bench throughput", "give the budgets with --budgets or --max-cache-blocks-per-seq, not both")
    if (args.budgets or args.policies) and args.kv_cache_dtype not in (None, "auto"):
        usage_error("bench throughput", "--kv-cache-dtype compares dtypes in the full KV vs Zipage run, not in a sweep")
    if args.num_kvcache_blocks is not None and args.kvcache_memory_gb is not None:
        usage_error("bench throughput", "give the pool with --num-kvcache-blocks or --kvcache-memory-gb, not both")
    options = engine_options(args)
    preset = PRESETS["quick" if args.quick else "default"]
    overrides = {
        **workload_overrides(args),
        "block_size": options.pop("kvcache_block_size", None),
        "pool_blocks": options.pop("num_kvcache_blocks", None),
        "pool_gb": options.pop("kvcache_memory_gb", None),
        "budget_blocks": options.pop("max_cache_blocks_per_seq", None),
    }
    fields = {k: v for k, v in overrides.items() if v is not None}
    workload = Workload(**{**asdict(preset), **fields})
    model = options.pop("model", None) or "default"
    return workload, model, options


def run(args: argparse.Namespace) -> int:
    workload, model, options = settings(args)
    warmup = options.pop("warmup", True)
    if args.budgets or args.policies:
        return _run_sweep(args, workload, model, options, warmup)
    if args.humaneval and args.gsm8k:
        usage_error("bench throughput", "--humaneval and --gsm8k are two tables: give one")
    if args.humaneval or args.gsm8k:
        return _run_task_table(args, workload, model, options, warmup)
    workload.check()
    pool = f"{workload.pool_gb} GiB" if workload.pool_gb else f"{workload.num_pool_blocks} blocks"
    log(f"workload: {workload.requests} requests, prompts {workload.prompt_len_min}-{workload.prompt_len_max} "
        f"tokens, {workload.max_tokens} generated each; pool {pool} of {workload.block_size} tokens; "
        f"budget {workload.budget_blocks} blocks")
    summary = run_benchmark(workload, model, options, interleave=not args.sequential, log=log, warmup=warmup)
    p = summary["pool"]
    log(f"pool: {p['blocks']} blocks ({p['kv_dtype']}, {p['block_bytes']} bytes each, {p['bytes'] / 2**20:.1f} MiB)")
    log(f"speedup {summary['speedup']:.2f}x (full {summary['throughput_full']:.1f} tok/s, zipage "
        f"{summary['throughput_zipage']:.1f} tok/s), compress time share "
        f"{100 * summary['compress_time_share']:.2f}%, full KV holds ~{summary['full_kv_capacity_seqs']:.1f} "
        f"requests at once")
    if "kv_cache_dtype_comparison" in summary:
        log(format_dtype_comparison(summary["kv_cache_dtype_comparison"]))
    return emit(summary, args)


def _run_task_table(args: argparse.Namespace, workload: Workload, model: str, options: dict, warmup: bool) -> int:
    task = "humaneval" if args.humaneval else "gsm8k"
    summary = run_task_table(task, args.humaneval or args.gsm8k, args.task_budget, model, options, args.limit,
                             args.max_tokens or 512, workload.block_size, interleave=not args.sequential, log=log,
                             warmup=warmup, pool_budget=args.pool_budget)
    log(f"{summary['problems']} {summary['split']} {task} problems, pool {summary['pool']['blocks']} blocks: full KV "
        f"{summary['throughput_full']:.1f} tok/s (pass@1 {summary['pass_at_1_full']:.3f}), default at "
        f"{summary['budget']} {summary['throughput_zipage']:.1f} tok/s (pass@1 "
        f"{summary['pass_at_1_compressed']:.3f}, peak KV {summary['peak_kv_ratio']:.2f}x): speedup "
        f"{summary['speedup']:.2f}x at pass ratio {summary['pass_ratio']}; tokens a step "
        f"{summary['kv_held_per_token_ratio'] * summary['kv_usage_ratio']:.2f}x = KV held per token "
        f"{summary['kv_held_per_token_ratio']:.2f}x less x pool usage {summary['kv_usage_ratio']:.2f}x")
    return emit(summary, args)


def _run_sweep(args: argparse.Namespace, workload: Workload, model: str, options: dict, warmup: bool) -> int:
    budgets = args.budgets or [workload.budget_blocks]
    policies = args.policies or ["zipage", "vnorm-prompt"]
    swept = sweep_workload(workload, budgets)
    log(f"sweep: {swept.requests} requests, prompts {swept.prompt_len_min}-{swept.prompt_len_max} tokens, "
        f"{swept.max_tokens} generated each; budgets {budgets} blocks, policies {policies}")
    summary = run_sweep(workload, budgets, policies, model, options, interleave=not args.sequential, log=log,
                        warmup=warmup)
    log(summary["pool_note"])
    log(format_sweep(summary))
    return emit(summary, args)
