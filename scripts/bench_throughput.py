"""Throughput at equal KV memory: full KV vs Zipage compression, in one process.

    python scripts/bench_throughput.py [--quick] [--json] [--requests 32] [--max-tokens 512]
        [--prompt-len 32 256] [--sequential] [--model default] [engine options, e.g. --max-cache-blocks-per-seq 4]
    python scripts/bench_throughput.py --quick --json --budgets 2 4 8 --policies zipage window   # sweep
    python scripts/bench_throughput.py --quick --json --kv-cache-dtype int8   # + quantized pools, same bytes

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
    pool_blocks: int | None = None  # None: (M + 1) per request, plus the dummy block (or pool_gb)
    pool_gb: float | None = None  # the pool in GiB instead (bytes / bytes per block, plus the dummy block)
    seed: int = 0

    @property
    def num_pool_blocks(self) -> int:
        """The pool in blocks of the default KV dtype (when not given in bytes)."""
        return self.pool_blocks or self.requests * (self.budget_blocks + 1) + 1

    def check(self) -> None:
        if self.requests < 1 or self.max_tokens < 1:
            raise ValueError("requests and max_tokens must be >= 1")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"need 1 <= prompt_len_min <= prompt_len_max, "
                             f"got {self.prompt_len_min}, {self.prompt_len_max}")
        if self.pool_blocks is not None and self.pool_gb is not None:
            raise ValueError("give the pool in blocks or in GiB, not both")
        if self.pool_gb is None:
            self.check_fits(self.num_pool_blocks)

    def check_fits(self, pool_blocks: int) -> None:
        """ValueError unless full KV can hold the longest request in a pool of `pool_blocks`."""
        pool_tokens = (pool_blocks - 1) * self.block_size
        longest = self.prompt_len_max + self.max_tokens
        if longest > pool_tokens:
            raise ValueError(f"the longest request ({longest} tokens) does not fit the pool of {pool_tokens} "
                             "tokens with full KV: raise --num-kvcache-blocks or lower --max-tokens")


@dataclass(frozen=True)
class Pool:
    """One engine's KV pool: `blocks` blocks (the dummy block 0 included) of `block_bytes` each."""

    kv_cache_dtype: str  # the engine option: "auto", "int8", "fp8" or "int4"
    kv_dtype: str  # what the pool stores (int4: uint8, two values a byte)
    block_bytes: int  # K and V of every layer (and a quantized pool's scales)
    blocks: int
    block_size: int

    @property
    def bytes(self) -> int:
        """Usable bytes (the dummy block left out, as kvcache_memory_gb counts them)."""
        return (self.blocks - 1) * self.block_bytes

    @property
    def tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "tokens": self.tokens}


def block_bytes(loaded, block_size: int, kv_cache_dtype: str, tensor_parallel_size: int = 1) -> tuple[str, int]:
    """(stored dtype, bytes per block) of an engine's pool, as LLMEngine computes them."""
    from pallas_kernels.kv_quant import kv_storage_dtype
    from zipage_jax.engine.pool_plan import kv_block_bytes

    mc = loaded.config
    dtype = kv_storage_dtype(kv_cache_dtype, loaded.model.dtype)
    kv_heads = -(-mc.num_kv_heads // tensor_parallel_size)  # per device
    return dtype.name, kv_block_bytes(mc.num_layers, block_size, kv_heads, mc.head_dim, dtype)


def size_pools(workload: Workload, loaded, kv_cache_dtypes: list[str], tensor_parallel_size: int = 1
               ) -> dict[str, Pool]:
    """One pool per KV dtype, all of the same bytes: the workload's pool in blocks of the first
    dtype (or `pool_gb`), and as many blocks of each other dtype as those bytes hold."""
    sizes = {d: block_bytes(loaded, workload.block_size, d, tensor_parallel_size) for d in kv_cache_dtypes}
    first = sizes[kv_cache_dtypes[0]][1]
    total = int(workload.pool_gb * 2**30) if workload.pool_gb else (workload.num_pool_blocks - 1) * first
    pools = {d: Pool(d, name, size, total // size + 1, workload.block_size) for d, (name, size) in sizes.items()}
    workload.check_fits(min(p.blocks for p in pools.values()))
    return pools


PRESETS = {
    # 32 concurrent long generations; full KV holds about 4 of them at once
    "default": Workload(requests=32, prompt_len_min=32, prompt_len_max=256, max_tokens=512, block_size=16,
                        budget_blocks=4),
    # a few minutes on a 2-core CPU; full KV holds about one request at once
    "quick": Workload(requests=6, prompt_len_min=16, prompt_len_max=48, max_tokens=208, block_size=16,
                      budget_blocks=2),
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


def engine_config(model: str, workload: Workload, compressed: bool, options: dict, pool: Pool,
                  scoring: dict = RECOMMENDED_SCORING):
    """The engine of one run: `options`, then the workload's sizes and `pool`; compressed runs
    get `scoring` (under the options) and the workload's budget."""
    from zipage_jax import EngineConfig

    base = dict(max_num_seqs=workload.requests, max_model_len=workload.prompt_len_max + workload.max_tokens)
    base.update({k: v for k, v in options.items() if k != "kvcache_memory_gb"})
    base.update(model=model, kvcache_block_size=workload.block_size, num_kvcache_blocks=pool.blocks,
                kv_cache_dtype=pool.kv_cache_dtype)
    if compressed:
        base = {**scoring, **base, "max_cache_blocks_per_seq": workload.budget_blocks}
    else:
        base["max_cache_blocks_per_seq"] = None
    return EngineConfig.from_options(**base)


def warm_up(engine, warmup: bool = True) -> dict:
    """Compiles every program the engine can reach (untimed); returns what it took."""
    start = time.perf_counter()
    compiled = engine.warmup(progress=False) if warmup else 0
    return {"warmup_seconds": time.perf_counter() - start, "warmup_programs_compiled": compiled}


class EngineRun:
    """An engine with its requests added, stepped by `drive` (the run with fewer tokens first)."""

    def __init__(self, name: str, engine):
        self.name, self.engine = name, engine
        self.compiles_at_start = engine.get_stats().num_compiles  # stats.num_compiles is refreshed by step()

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def generated(self) -> int:
        return self.engine.stats.generation_tokens

    @property
    def num_compiles(self) -> int:
        """Programs compiled since the run started (after the warm-up)."""
        return self.engine.get_stats().num_compiles - self.compiles_at_start

    def wait_for_device(self) -> float:
        """Blocks until the engine's dispatched work is done; returns the seconds waited."""
        import jax

        start = time.perf_counter()
        jax.block_until_ready(self.engine.runner.state)
        return time.perf_counter() - start


class TimedRun(EngineRun):
    """One engine working through the workload, one step at a time, timing only its own steps
    (less the compile time inside them) and sampling its stats after each."""

    def __init__(self, name: str, engine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True):
        from zipage_jax import SamplingParams

        super().__init__(name, engine)
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.ids = [engine.add_request(p, params) for p in prompts]
        self.finished: dict[str, dict] = {}
        self.running: list[int] = []
        self.seconds = 0.0
        self.compile_seconds = 0.0
        self.compress_compile_seconds = 0.0

    def step(self) -> None:
        runner = self.engine.runner
        before, before_compress = runner.compile_seconds, runner.compressor.seconds
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        compiled = runner.compile_seconds - before
        self.compile_seconds += compiled
        self.compress_compile_seconds += runner.compressor.seconds - before_compress
        self.seconds += max(0.0, elapsed - compiled)
        for out in outputs:
            if out.finished:
                self.finished[out.request_id] = out.to_dict()
        self.running.append(self.engine.get_stats().num_running)

    def end_turn(self) -> None:
        self.seconds += self.wait_for_device()

    def results(self) -> list[dict]:
        results = [self.finished[i] for i in self.ids]
        lengths = {len(r["token_ids"]) for r in results}
        if self.ignore_eos and lengths != {self.max_tokens}:
            raise RuntimeError(f"{self.name}: expected {self.max_tokens} tokens per request with ignore_eos, "
                               f"got lengths {sorted(lengths)}")
        return results


TURN_STEPS = 16  # steps an interleaved run takes before the next run's turn


def drive(runs: list, interleave: bool, turn_steps: int = TURN_STEPS) -> None:
    """Steps the runs to completion: one after the other, or interleaved, in turns of
    `turn_steps` steps, the run with the fewest tokens so far taking the next turn (all finish
    together and see the same machine load). A turn ends by waiting for the run's dispatched
    work (`end_turn`, counted in its time): with asynchronous scheduling, an engine's last step
    would otherwise run on the device during the next engine's turn and be timed there."""
    while pending := [r for r in runs if not r.done]:
        run = min(pending, key=lambda r: r.generated) if interleave else pending[0]
        for _ in range(turn_steps if interleave else sys.maxsize):
            run.step()
            if run.done:
                break
        run.end_turn()


def summarize(run: TimedRun, warm: dict) -> dict:
    engine, results = run.engine, run.results()
    stats = engine.get_stats()
    if engine.block_manager.num_free_blocks != engine.block_manager.num_usable_blocks:
        raise RuntimeError(f"{run.name}: KV blocks leaked after the run")
    compress_seconds = max(0.0, engine.runner.compress_seconds - run.compress_compile_seconds)
    output_tokens = sum(len(r["token_ids"]) for r in results)
    config = engine.config
    compressed = config.max_cache_blocks_per_seq is not None
    return {
        "throughput": output_tokens / run.seconds,
        "output_tokens": output_tokens,
        "wall_seconds": run.seconds,
        "compile_seconds_excluded": run.compile_seconds,
        "compiles_in_timed_run": run.num_compiles,
        **warm,
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
        "kv_cache_dtype": config.kv_cache_dtype,
        "pool_blocks": config.num_kvcache_blocks,
        "block_bytes": engine.pool.block_bytes,
        "pool_bytes": (config.num_kvcache_blocks - 1) * engine.pool.block_bytes,
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
                f"compress share {100 * row['compress_time_share']:.1f}%, {row['wall_seconds']:.1f}s "
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
    loaded = loaded or load_model(model, dtype=options.get("dtype"))
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
    loaded = loaded or load_model(model, dtype=options.get("dtype"))
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


def run_humaneval(split: str, budget_tokens: int, model: str, options: dict | None = None, limit: int | None = None,
                  max_tokens: int = 512, block_size: int = 16, interleave: bool = True, log=None,
                  warmup: bool = True) -> dict:
    """The paper's table on HumanEval: full KV and the default policy at `budget_tokens`, on one
    pool that holds every request at that budget, timed side by side on the problems' chat
    prompts (greedy, ending at EOS); both runs' answers graded, so the pass ratio comes from the
    very outputs that were timed."""
    from zipage_jax.chat import chat_prompt_ids
    from zipage_jax.evals import humaneval as he
    from zipage_jax.models.loading import load_model

    options = {k: v for k, v in (options or {}).items() if k not in ("eviction_policy", "kvcache_memory_gb")}
    loaded = load_model(model, dtype=options.get("dtype"))
    problems = he.load_problems((split,), limit)
    prompts = [chat_prompt_ids(loaded.tokenizer, he.messages(p)) for p in problems]
    lengths = [len(p) for p in prompts]
    workload = Workload(requests=len(prompts), prompt_len_min=min(lengths), prompt_len_max=max(lengths),
                        max_tokens=max_tokens, block_size=block_size, budget_blocks=-(-budget_tokens // block_size))
    workload.check()
    pool = size_pools(workload, loaded, ["auto"], options.get("tensor_parallel_size", 1))["auto"]
    compressed = f"default@{workload.budget_blocks * block_size}"
    configs = {"full": engine_config(model, workload, False, options, pool),
               compressed: engine_config(model, workload, True, options, pool, scoring={})}
    outputs: dict[str, list[dict]] = {}
    rows = bench_modes(loaded, configs, prompts, max_tokens, interleave, log, warmup, ignore_eos=False,
                       answers=outputs)
    answers = {(name, p.task_id): out for name, outs in outputs.items() for p, out in zip(problems, outs)}
    statuses = he.grade(problems, answers)
    for name, row in rows.items():
        row["passed"] = sum(statuses[name, p.task_id] == "passed" for p in problems)
        row["pass_at_1"] = row["passed"] / len(problems)
        row["mean_generated_tokens"] = row["output_tokens"] / len(problems)
    full, zipage = rows["full"], rows[compressed]
    return {
        **pair_summary(full, zipage, pool, float(np.mean(lengths)) + full["mean_generated_tokens"]),
        "pass_at_1_full": full["pass_at_1"],
        "pass_at_1_compressed": zipage["pass_at_1"],
        "pass_ratio": zipage["passed"] / full["passed"] if full["passed"] else None,
        "tokens_ratio": zipage["mean_generated_tokens"] / full["mean_generated_tokens"],
        "split": split,
        "problems": len(problems),
        "budget_tokens": workload.budget_blocks * block_size,
        "model": str(loaded.source),
        "options": options,
        "interleaved": interleave,
        "warmup": warmup,
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


def workload_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A parser with the flags every workload has: --quick, --json, --requests, --max-tokens, --prompt-len."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    return parser


def workload_overrides(args: argparse.Namespace) -> dict:
    """The workload_parser flags as workload fields (None: the preset's)."""
    return {"requests": args.requests, "max_tokens": args.max_tokens,
            "prompt_len_min": args.prompt_len[0] if args.prompt_len else None,
            "prompt_len_max": args.prompt_len[1] if args.prompt_len else None}


def parse_args(argv: list[str] | None):
    from zipage_jax.cli_options import add_engine_arguments, engine_options
    from zipage_jax.compress.policies import POLICIES

    parser = workload_parser(__doc__, "the scaled-down preset (a few minutes on a CPU)")
    parser.add_argument("--sequential", action="store_true",
                        help="run full KV, then Zipage (default: interleave their steps, see above)")
    parser.add_argument("--budgets", type=int, nargs="+", metavar="M",
                        help="sweep: compressed budgets in blocks (max_cache_blocks_per_seq values)")
    parser.add_argument("--policies", nargs="+", metavar="POLICY", choices=list(POLICIES),
                        help=f"sweep: eviction policies, of {', '.join(POLICIES)} (default: zipage vnorm-prompt)")
    parser.add_argument("--humaneval", choices=("dev", "heldout"),
                        help="the paper's table on HumanEval's chat prompts of this split: full KV against the "
                             "default policy at --humaneval-budget, throughput and pass ratio from one run")
    parser.add_argument("--humaneval-budget", type=int, default=128, help="kv_budget tokens of the compressed run")
    parser.add_argument("--limit", type=int, help="--humaneval: at most this many problems")
    # engine options: --model, --kvcache-block-size, --num-kvcache-blocks, --max-cache-blocks-per-seq, ...;
    # --no-warmup compiles on first use instead of before timing (that compile time is left out too)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    if args.budgets and args.max_cache_blocks_per_seq is not None:
        parser.error("give the budgets with --budgets or --max-cache-blocks-per-seq, not both")
    if (args.budgets or args.policies) and args.kv_cache_dtype not in (None, "auto"):
        parser.error("--kv-cache-dtype compares dtypes in the full KV vs Zipage run, not in a sweep")
    if args.num_kvcache_blocks is not None and args.kvcache_memory_gb is not None:
        parser.error("give the pool with --num-kvcache-blocks or --kvcache-memory-gb, not both")
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
    args.warmup = options.pop("warmup", True)  # done here, timed (see warm_up), not by the engine
    return args, workload, model, options


def main(argv: list[str] | None = None) -> int:
    args, workload, model, options = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.budgets or args.policies:
        return main_sweep(args, workload, model, options, log)
    if args.humaneval:
        return main_humaneval(args, workload, model, options, log)
    workload.check()
    pool = f"{workload.pool_gb} GiB" if workload.pool_gb else f"{workload.num_pool_blocks} blocks"
    log(f"workload: {workload.requests} requests, prompts {workload.prompt_len_min}-{workload.prompt_len_max} "
        f"tokens, {workload.max_tokens} generated each; pool {pool} of {workload.block_size} tokens; "
        f"budget {workload.budget_blocks} blocks")
    summary = run_benchmark(workload, model, options, interleave=not args.sequential, log=log,
                            warmup=args.warmup)
    p = summary["pool"]
    log(f"pool: {p['blocks']} blocks ({p['kv_dtype']}, {p['block_bytes']} bytes each, {p['bytes'] / 2**20:.1f} MiB)")
    log(f"speedup {summary['speedup']:.2f}x (full {summary['throughput_full']:.1f} tok/s, zipage "
        f"{summary['throughput_zipage']:.1f} tok/s), compress time share "
        f"{100 * summary['compress_time_share']:.2f}%, full KV holds ~{summary['full_kv_capacity_seqs']:.1f} "
        f"requests at once")
    if "kv_cache_dtype_comparison" in summary:
        log(format_dtype_comparison(summary["kv_cache_dtype_comparison"]))
    from zipage_jax.run_info import run_info

    summary["run"] = run_info()
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


def main_humaneval(args, workload: Workload, model: str, options: dict, log) -> int:
    summary = run_humaneval(args.humaneval, args.humaneval_budget, model, options, args.limit,
                            args.max_tokens or 512, workload.block_size, interleave=not args.sequential, log=log,
                            warmup=args.warmup)
    log(f"{summary['problems']} {summary['split']} problems, pool {summary['pool']['blocks']} blocks: full KV "
        f"{summary['throughput_full']:.1f} tok/s (pass@1 {summary['pass_at_1_full']:.3f}), default at "
        f"{summary['budget_tokens']} tokens {summary['throughput_zipage']:.1f} tok/s (pass@1 "
        f"{summary['pass_at_1_compressed']:.3f}): speedup {summary['speedup']:.2f}x at pass ratio "
        f"{summary['pass_ratio']}")
    from zipage_jax.run_info import run_info

    summary["run"] = run_info()
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


def main_sweep(args, workload: Workload, model: str, options: dict, log) -> int:
    budgets = args.budgets or [workload.budget_blocks]
    policies = args.policies or ["zipage", "vnorm-prompt"]
    swept = sweep_workload(workload, budgets)
    log(f"sweep: {swept.requests} requests, prompts {swept.prompt_len_min}-{swept.prompt_len_max} tokens, "
        f"{swept.max_tokens} generated each; budgets {budgets} blocks, policies {policies}")
    summary = run_sweep(workload, budgets, policies, model, options, interleave=not args.sequential, log=log,
                        warmup=args.warmup)
    log(summary["pool_note"])
    log(format_sweep(summary))
    from zipage_jax.run_info import run_info

    summary["run"] = run_info()
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
