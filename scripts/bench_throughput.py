"""Throughput at equal KV memory: full KV vs Zipage compression, in one process.

    python scripts/bench_throughput.py [--quick] [--json] [--requests 32] [--max-tokens 512]
        [--prompt-len 32 256] [--sequential] [--model default] [engine options, e.g. --max-cache-blocks-per-seq 4]
    python scripts/bench_throughput.py --quick --json --budgets 2 4 8 --policies zipage window   # sweep

One workload (long greedy generations with `ignore_eos`, mixed prompt lengths cut from the
standard library's argparse.py) and one KV pool (`--num-kvcache-blocks`, the same for both
runs) are run twice in one process: with full KV, and with compression to
`--max-cache-blocks-per-seq` blocks under the recommended scoring (global score + pooling +
lightning redundancy). The pool defaults to what compression needs to hold every request at
once, so full KV holds only a few and preempts or queues the rest.

The two engines are stepped in turn, the one with fewer tokens so far next, and each is timed
over its own steps only: both finish together and see the same load on a shared machine
(`--sequential` runs full KV, then Zipage). Each engine first warms up on the same prompts
(a short, untimed generation that compiles the prefill and first decode shapes); shapes first
met in the timed run compile there, and that compile time (JAX's compile events) is left out
of the step times and of the compaction time. Compactions are timed by blocking on each
(`profile_compress`), so they never overlap the host's work.

The default preset is the 32-request measurement of issue 4 (20-30 minutes on a 2-core CPU,
a few on a GPU); `--quick` is a scaled-down one (6 requests, about 4 minutes on 2 busy cores
once the persistent compilation cache is warm; the first run on a machine compiles longer). The last line of `--json`
is one JSON object: throughput_full, throughput_zipage, speedup, compress_time_share, the
per-run figures under "full" / "zipage", and the workload.

Sweep (`--budgets M1 M2 ...` and/or `--policies P1 P2 ...`): full KV once and compression with
every (policy, budget) pair, all on one pool sized for the LARGEST budget
(`requests * (max M + 1) + 1` blocks unless `--num-kvcache-blocks` is given), so every point
uses the same KV bytes; the policy replaces `eviction_policy` in the recommended scoring, the
rest of the scoring is the same for every policy. All the engines are stepped in turn as above.
The JSON then holds a "sweep" list, one row per point (policy, budget_blocks, budget_tokens,
budget_fraction = budget / mean final request length, throughput, mean/peak running,
preemptions, compressions, compress_time_share, speedup vs full KV, and throughput_vs_zipage
when zipage ran at the same budget); `scripts/plot_results.py` plots it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

RECOMMENDED_SCORING = dict(eviction_policy="zipage", use_global_score=True, enable_pooling=True, redundancy="lightning")


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_len_min: int
    prompt_len_max: int
    max_tokens: int
    block_size: int
    budget_blocks: int  # M: blocks kept per compressed sequence
    pool_blocks: int | None = None  # None: (M + 1) per request, plus the dummy block
    warmup_tokens: int = 8
    seed: int = 0

    @property
    def num_pool_blocks(self) -> int:
        return self.pool_blocks or self.requests * (self.budget_blocks + 1) + 1

    def check(self) -> None:
        if self.requests < 1 or self.max_tokens < 1 or self.warmup_tokens < 1:
            raise ValueError("requests, max_tokens and warmup_tokens must be >= 1")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"need 1 <= prompt_len_min <= prompt_len_max, "
                             f"got {self.prompt_len_min}, {self.prompt_len_max}")
        pool_tokens = (self.num_pool_blocks - 1) * self.block_size
        longest = self.prompt_len_max + self.max_tokens
        if longest > pool_tokens:
            raise ValueError(f"the longest request ({longest} tokens) does not fit the pool of {pool_tokens} "
                             "tokens with full KV: raise --num-kvcache-blocks or lower --max-tokens")


PRESETS = {
    # issue 4, item 7: 32 concurrent long generations; full KV holds about 4 of them at once
    "default": Workload(requests=32, prompt_len_min=32, prompt_len_max=256, max_tokens=512, block_size=16,
                        budget_blocks=4),
    # a few minutes on a 2-core CPU; full KV holds about one request at once
    "quick": Workload(requests=6, prompt_len_min=16, prompt_len_max=48, max_tokens=208, block_size=16,
                      budget_blocks=2, warmup_tokens=4),
}


def make_prompts(tokenizer, workload: Workload) -> list[list[int]]:
    """Mixed-length prompts, each a different window of real text (no shared prefixes)."""
    import argparse as text_module

    with open(text_module.__file__, encoding="utf-8") as f:
        tokens = list(tokenizer(f.read())["input_ids"])
    if len(tokens) < workload.prompt_len_max:
        raise ValueError(f"the source text has only {len(tokens)} tokens")
    rng = np.random.default_rng(workload.seed)
    lengths = np.linspace(workload.prompt_len_min, workload.prompt_len_max, workload.requests).round().astype(int)
    rng.shuffle(lengths)
    stride = max(1, (len(tokens) - workload.prompt_len_max) // workload.requests)
    return [tokens[i * stride:i * stride + n] for i, n in enumerate(lengths)]


class CompileTimer:
    """Wall time spent tracing, lowering and compiling (JAX compile events), by function."""

    PREFIX = "/jax/core/compile/"

    def __init__(self):
        self.spans: list[tuple[float, float, str]] = []
        self.num_compiles = 0  # lowerings to MLIR: one per new shape (then compiled or read from disk)

    def __enter__(self) -> "CompileTimer":
        from jax import monitoring

        monitoring.register_event_time_span_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        monitoring.unregister_event_time_span_listener(self._listen)

    def _listen(self, event: str, start: float, end: float, **kwargs) -> None:
        if event.startswith(self.PREFIX):
            self.num_compiles += event.endswith("jaxpr_to_mlir_module_duration")
            self.spans.append((start, end, str(kwargs.get("fun_name", ""))))

    def intervals(self) -> list[tuple[float, float, str]]:
        """Disjoint intervals, each named by the outermost function compiled in it."""
        merged: list[list] = []
        for start, end, name in sorted(self.spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end, name])
        return [tuple(m) for m in merged]

    def seconds(self, name_contains: str = "") -> float:
        return sum(end - start for start, end, name in self.intervals() if name_contains in name)


def engine_config(model: str, workload: Workload, compressed: bool, options: dict):
    from zipage_jax import EngineConfig

    base = dict(max_num_seqs=workload.requests, max_model_len=workload.prompt_len_max + workload.max_tokens)
    base.update(options)
    base.update(model=model, kvcache_block_size=workload.block_size, num_kvcache_blocks=workload.num_pool_blocks)
    if compressed:
        base = {**RECOMMENDED_SCORING, **base, "max_cache_blocks_per_seq": workload.budget_blocks}
    else:
        base["max_cache_blocks_per_seq"] = None
    return EngineConfig.from_options(**base)


class TimedRun:
    """One engine working through the workload, one step at a time, timing only its own steps
    (less the compile time inside them) and sampling its stats after each."""

    def __init__(self, name: str, engine, prompts: list[list[int]], max_tokens: int, compiles: CompileTimer):
        from zipage_jax import SamplingParams

        self.name, self.engine, self.max_tokens, self.compiles = name, engine, max_tokens, compiles
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.ids = [engine.add_request(p, params) for p in prompts]
        self.finished: dict[str, dict] = {}
        self.running: list[int] = []
        self.seconds = 0.0
        self.compile_seconds = 0.0
        self.compress_compile_seconds = 0.0
        self.num_compiles = 0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def generated(self) -> int:
        return self.engine.stats.generation_tokens

    def step(self) -> None:
        before, before_compress = self.compiles.seconds(), self.compiles.seconds("compress")
        before_count = self.compiles.num_compiles
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        compiled = self.compiles.seconds() - before
        self.compile_seconds += compiled
        self.compress_compile_seconds += self.compiles.seconds("compress") - before_compress
        self.seconds += max(0.0, elapsed - compiled)
        self.num_compiles += self.compiles.num_compiles - before_count
        for out in outputs:
            if out.finished:
                self.finished[out.request_id] = out.to_dict()
        self.running.append(self.engine.get_stats().num_running)

    def results(self) -> list[dict]:
        results = [self.finished[i] for i in self.ids]
        lengths = {len(r["token_ids"]) for r in results}
        if lengths != {self.max_tokens}:
            raise RuntimeError(f"{self.name}: expected {self.max_tokens} tokens per request with ignore_eos, "
                               f"got lengths {sorted(lengths)}")
        return results


def drive(runs: list[TimedRun], interleave: bool) -> None:
    """Steps the runs to completion: one after the other, or interleaved so that the run with
    the fewest tokens so far steps next (all finish together and see the same machine load)."""
    while pending := [r for r in runs if not r.done]:
        run = min(pending, key=lambda r: r.generated) if interleave else pending[0]
        run.step()


def summarize(run: TimedRun, warmup_seconds: float) -> dict:
    engine, results = run.engine, run.results()
    stats = engine.get_stats()
    if engine.block_manager.num_free_blocks != engine.block_manager.num_usable_blocks:
        raise RuntimeError(f"{run.name}: KV blocks leaked after the run")
    compress_seconds = max(0.0, engine.runner.compress_seconds - run.compress_compile_seconds)
    output_tokens = sum(len(r["token_ids"]) for r in results)
    compressed = engine.config.max_cache_blocks_per_seq is not None
    return {
        "throughput": output_tokens / run.seconds,
        "output_tokens": output_tokens,
        "wall_seconds": run.seconds,
        "compile_seconds_excluded": run.compile_seconds,
        "compiles_in_timed_run": run.num_compiles,
        "warmup_seconds": warmup_seconds,
        "steps": len(run.running),
        "mean_running": float(np.mean(run.running)),
        "peak_running": int(max(run.running)),
        "preemptions": stats.num_preemptions,
        "compressions": stats.num_compressions,
        "kv_tokens_evicted": stats.kv_tokens_evicted,
        "compress_seconds": compress_seconds,
        "compress_time_share": compress_seconds / run.seconds,
        "prefill_tokens": stats.prefill_tokens,
        "kv_blocks_peak_max": max(r["metrics"]["kv_blocks_peak"] for r in results),
        "query_slots": stats.num_query_slots if compressed else None,
    }


def bench_modes(loaded, model: str, workload: Workload, prompts: list[list[int]], options: dict,
                interleave: bool = True, log=None, configs: dict | None = None) -> dict[str, dict]:
    """Full KV and Zipage (or the named `configs`) on fresh engines sharing the loaded model,
    each after a warm-up."""
    from zipage_jax.engine.llm_engine import LLMEngine

    configs = configs or {"full": engine_config(model, workload, False, options),
                          "zipage": engine_config(model, workload, True, options)}
    warmup_seconds = {}
    for name, config in configs.items():
        start = time.perf_counter()
        warm = TimedRun(name, LLMEngine(config, loaded=loaded), prompts, workload.warmup_tokens, CompileTimer())
        drive([warm], interleave=False)
        warmup_seconds[name] = time.perf_counter() - start
        del warm
    with CompileTimer() as compiles:
        runs = []
        for name, config in configs.items():
            engine = LLMEngine(config, loaded=loaded)
            engine.runner.profile_compress = True
            runs.append(TimedRun(name, engine, prompts, workload.max_tokens, compiles))
        drive(runs, interleave)
    rows = {run.name: summarize(run, warmup_seconds[run.name]) for run in runs}
    for name, row in rows.items():
        if log:
            log(f"{name:>8}: {row['throughput']:.1f} tok/s, running mean {row['mean_running']:.1f} peak "
                f"{row['peak_running']}, preemptions {row['preemptions']}, compressions {row['compressions']}, "
                f"compress share {100 * row['compress_time_share']:.1f}%, {row['wall_seconds']:.1f}s "
                f"(+{row['compile_seconds_excluded']:.1f}s compile excluded, {row['warmup_seconds']:.1f}s warm-up)")
    return rows


def run_benchmark(workload: Workload, model: str = "default", options: dict | None = None, loaded=None,
                  interleave: bool = True, log=None) -> dict:
    """Full KV and Zipage on the same workload and pool. Returns the summary dict."""
    from zipage_jax.models.loading import load_model

    options = dict(options or {})
    workload.check()
    loaded = loaded or load_model(model, dtype=options.get("dtype"))
    prompts = make_prompts(loaded.tokenizer, workload)
    mean_len = float(np.mean([len(p) for p in prompts])) + workload.max_tokens
    pool_tokens = (workload.num_pool_blocks - 1) * workload.block_size
    rows = bench_modes(loaded, model, workload, prompts, options, interleave, log)
    full, zipage = rows["full"], rows["zipage"]
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
        "budget_tokens": workload.budget_blocks * workload.block_size,
        "pool_blocks": workload.num_pool_blocks,
        "pool_tokens": pool_tokens,
        "full_kv_capacity_seqs": pool_tokens / mean_len,  # requests of mean final length the pool holds
        "model": str(loaded.source),
        "scoring": RECOMMENDED_SCORING,
        "options": options,
        "interleaved": interleave,
        "workload": asdict(workload),
        "full": full,
        "zipage": zipage,
    }


def sweep_workload(workload: Workload, budgets: list[int]) -> Workload:
    """The workload with its pool fixed for the largest budget (unless given) and that budget."""
    largest = max(budgets)
    pool = workload.pool_blocks or workload.requests * (largest + 1) + 1
    return replace(workload, budget_blocks=largest, pool_blocks=pool)


def pool_note(workload: Workload, budgets: list[int]) -> str:
    """How the sweep's one pool was chosen (workload before `sweep_workload`)."""
    pooled = sweep_workload(workload, budgets)
    origin = "as given" if workload.pool_blocks else f"sized for the largest budget, {max(budgets)} blocks"
    return (f"one pool of {pooled.num_pool_blocks} blocks of {pooled.block_size} ({origin}) for full KV and "
            "every point: the same KV bytes everywhere")


def run_sweep(workload: Workload, budgets: list[int], policies: list[str], model: str = "default",
              options: dict | None = None, loaded=None, interleave: bool = True, log=None) -> dict:
    """Full KV once and every (policy, budget) on one pool (sized for the largest budget unless given)."""
    from zipage_jax.models.loading import load_model

    if not budgets or not policies or min(budgets) < 1:
        raise ValueError("a sweep needs budgets >= 1 and at least one policy")
    options = {k: v for k, v in (options or {}).items() if k != "eviction_policy"}
    note = pool_note(workload, budgets)
    workload = sweep_workload(workload, sorted(set(budgets)))
    workload.check()
    loaded = loaded or load_model(model, dtype=options.get("dtype"))
    prompts = make_prompts(loaded.tokenizer, workload)
    mean_len = float(np.mean([len(p) for p in prompts])) + workload.max_tokens
    pool_tokens = (workload.num_pool_blocks - 1) * workload.block_size
    points = {f"{policy}@{m}": (policy, m) for policy in dict.fromkeys(policies) for m in sorted(set(budgets))}
    configs = {"full": engine_config(model, workload, False, options)}
    configs.update({name: engine_config(model, replace(workload, budget_blocks=m), True,
                                        {**options, "eviction_policy": policy})
                    for name, (policy, m) in points.items()})
    rows = bench_modes(loaded, model, workload, prompts, options, interleave, log, configs=configs)
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
        "budgets": sorted(set(budgets)),
        "policies": list(dict.fromkeys(policies)),
        "pool_blocks": workload.num_pool_blocks,
        "pool_tokens": pool_tokens,
        "pool_note": note,
        "mean_final_len": mean_len,
        "full_kv_capacity_seqs": pool_tokens / mean_len,
        "model": str(loaded.source),
        "scoring": {k: v for k, v in RECOMMENDED_SCORING.items() if k != "eviction_policy"},
        "options": options,
        "interleaved": interleave,
        "workload": asdict(workload),
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


def parse_args(argv: list[str] | None):
    from zipage_jax.cli_options import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the scaled-down preset (a few minutes on a CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--warmup-tokens", type=int)
    parser.add_argument("--sequential", action="store_true",
                        help="run full KV, then Zipage (default: interleave their steps, see above)")
    parser.add_argument("--budgets", type=int, nargs="+", metavar="M",
                        help="sweep: compressed budgets in blocks (max_cache_blocks_per_seq values)")
    parser.add_argument("--policies", nargs="+", metavar="POLICY",
                        help="sweep: eviction policies (default with --budgets: zipage window)")
    add_engine_arguments(parser)  # --model, --kvcache-block-size, --num-kvcache-blocks, --max-cache-blocks-per-seq...
    args = parser.parse_args(argv)
    if args.budgets and args.max_cache_blocks_per_seq is not None:
        parser.error("give the budgets with --budgets or --max-cache-blocks-per-seq, not both")
    if args.policies:
        from zipage_jax.config import EVICTION_POLICIES

        bad = [p for p in args.policies if p not in EVICTION_POLICIES]
        if bad:
            parser.error(f"unknown policy {', '.join(bad)}: choose from {', '.join(EVICTION_POLICIES)}")
    options = engine_options(args)
    preset = PRESETS["quick" if args.quick else "default"]
    overrides = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "warmup_tokens": args.warmup_tokens,
        "prompt_len_min": args.prompt_len[0] if args.prompt_len else None,
        "prompt_len_max": args.prompt_len[1] if args.prompt_len else None,
        "block_size": options.pop("kvcache_block_size", None),
        "pool_blocks": options.pop("num_kvcache_blocks", None),
        "budget_blocks": options.pop("max_cache_blocks_per_seq", None),
    }
    fields = {k: v for k, v in overrides.items() if v is not None}
    workload = Workload(**{**asdict(preset), **fields})
    model = options.pop("model", None) or "default"
    return args, workload, model, options


def main(argv: list[str] | None = None) -> int:
    args, workload, model, options = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.budgets or args.policies:
        return main_sweep(args, workload, model, options, log)
    workload.check()
    log(f"workload: {workload.requests} requests, prompts {workload.prompt_len_min}-{workload.prompt_len_max} "
        f"tokens, {workload.max_tokens} generated each; pool {workload.num_pool_blocks} blocks of "
        f"{workload.block_size}; budget {workload.budget_blocks} blocks")
    summary = run_benchmark(workload, model, options, interleave=not args.sequential, log=log)
    log(f"speedup {summary['speedup']:.2f}x (full {summary['throughput_full']:.1f} tok/s, zipage "
        f"{summary['throughput_zipage']:.1f} tok/s), compress time share "
        f"{100 * summary['compress_time_share']:.2f}%, full KV holds ~{summary['full_kv_capacity_seqs']:.1f} "
        f"requests at once")
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


def main_sweep(args, workload: Workload, model: str, options: dict, log) -> int:
    budgets = args.budgets or [workload.budget_blocks]
    policies = args.policies or ["zipage", "vnorm-window"]
    pooled = sweep_workload(workload, budgets)
    log(f"sweep: {pooled.requests} requests, prompts {pooled.prompt_len_min}-{pooled.prompt_len_max} tokens, "
        f"{pooled.max_tokens} generated each; {pool_note(workload, budgets)}; "
        f"budgets {budgets} blocks, policies {policies}")
    summary = run_sweep(workload, budgets, policies, model, options, interleave=not args.sequential, log=log)
    log(summary["pool_note"])
    log(format_sweep(summary))
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
