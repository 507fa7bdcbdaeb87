"""Long generations on one KV pool: step time, host time and compiles per window of generated
tokens, with a KV budget and with full KV side by side.

    python scripts/bench_long.py [--quick] [--json] [--requests 32] [--max-tokens 4096] [--budget 256]
        [--window 512] [--prompt-len 64 256] [--repetition-penalty 1.1] [engine options, e.g. --kv-cache-dtype int8]

Workload: N requests (default 32), prompts cut from the standard library's argparse.py (no
shared prefixes), each generating --max-tokens tokens greedily with EOS ignored; every other
request has a repetition penalty. Two engines share the loaded model and one pool of the same
number of blocks, so the same bytes: "compressed" keeps --budget tokens per sequence (the
engine's default policy and scoring; engine options such as --eviction-policy change them),
"full" keeps every token. The pool defaults to what compression needs to hold all N at once,
N * (budget / block + 1) + 1 blocks, so full KV holds fewer and preempts or queues the rest.
Both engines first compile every program they can reach (`LLMEngine.warmup`, untimed); then
their steps are interleaved in turns of 16 steps, the engine with fewer generated tokens
taking the next turn (as in bench_throughput.py), so both see the same load on a shared
machine; a turn ends with a wait for the engine's dispatched work, added to its last step.

Windows are positions in each request's generation: window k holds tokens [k W, (k+1) W) of
every request (W = --window). A step belongs to the window of the median position of the
tokens it hands back; a step that hands back none (a prefill, a compaction) belongs to the
window of the step before it. Under compression every request advances in lockstep, so a
window is also the run's k-th N * W tokens. Per window: the median step time
(EngineStats.step_seconds per step), the median host time per step
(`engine.last_step_host_seconds`: step time less the wait for the device), tokens/s (the
tokens its steps handed back over their time) and compiles.

`first_full_window` is the first window that starts after every request's first compaction (the
position where its output metrics first count a compression); the full KV run reports the
compressed run's index so that the windows line up. Goals, checked in "goals": the compressed
run's step time flat (the last window within 10% of `first_full_window`'s), no compiles after
the warm-up, host time at most 10% of the step.

The last line of --json is one JSON object: for "compressed" and "full" each
step_ms_by_window, host_ms_by_window, tokens_per_s_by_window, compiles_by_window,
first_full_window, compiles_after_warmup, host_share (host time / step time), preemptions and
totals; then "goals", the pool (blocks, bytes per block), the workload, the machine's load
average at the start, and "run" (scripts/run_info.py: commit, date, load average at the end).

The default preset is the mission's workload (32 requests x 4096 tokens: a GPU run; hours on a
2-core CPU). `--quick` is sized for about 10 minutes on the 2-core CPU with the default model
once the persistent compilation cache is warm (the first run compiles about 40 programs, a few
minutes more): 2 requests x 2048 tokens, block 64, budget 256, a pool of 35 blocks, in which
full KV holds both requests up to about 1,000 tokens each and one after that.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_throughput as bt  # noqa: E402
from run_info import run_info  # noqa: E402

FLAT_TOLERANCE = 0.10  # the last window's step time within 10% of the first full window's
HOST_SHARE_GOAL = 0.10


@dataclass(frozen=True)
class LongWorkload:
    requests: int
    prompt_len_min: int
    prompt_len_max: int
    max_tokens: int
    block_size: int
    budget_tokens: int
    window: int = 512
    repetition_penalty: float = 1.1  # for every other request
    pool_blocks: int | None = None  # None: what compression needs, N * (budget / block + 1) + 1
    seed: int = 0

    def pool_workload(self) -> bt.Workload:
        """The same requests as bench_throughput's workload (prompts, pool sizing and checks)."""
        if self.budget_tokens < self.block_size or self.budget_tokens % self.block_size:
            raise ValueError(f"the budget ({self.budget_tokens} tokens) must be a multiple of the block size "
                             f"({self.block_size})")
        if self.window < 1:
            raise ValueError(f"the window must be >= 1 token, got {self.window}")
        return bt.Workload(requests=self.requests, prompt_len_min=self.prompt_len_min,
                           prompt_len_max=self.prompt_len_max, max_tokens=self.max_tokens,
                           block_size=self.block_size, budget_blocks=self.budget_tokens // self.block_size,
                           pool_blocks=self.pool_blocks, seed=self.seed)

    @property
    def num_windows(self) -> int:
        return -(-self.max_tokens // self.window)


PRESETS = {
    # the mission's workload: 32 concurrent requests of 4096 tokens, budget 256
    "default": LongWorkload(requests=32, prompt_len_min=64, prompt_len_max=256, max_tokens=4096, block_size=64,
                            budget_tokens=256),
    # about 10 minutes on a 2-core CPU; the pool (35 blocks of 64) holds one full KV request
    "quick": LongWorkload(requests=2, prompt_len_min=32, prompt_len_max=64, max_tokens=2048, block_size=64,
                          budget_tokens=256, pool_blocks=35),
}


@dataclass
class StepRecord:
    window: int
    seconds: float  # step() wall time (EngineStats.step_seconds), plus the wait at the end of a turn
    host_seconds: float  # of which host work (engine.last_step_host_seconds)
    tokens: int  # generated tokens the step handed back
    compiles: int
    running: int


class WindowedRun(bt.EngineRun):
    """One engine through the workload, one step at a time, each step recorded in its window."""

    def __init__(self, name: str, engine, prompts: list[list[int]], workload: LongWorkload, log=None):
        from zipage_jax import SamplingParams

        super().__init__(name, engine)
        self.workload, self.log = workload, log
        self.ids = []
        for i, prompt in enumerate(prompts):
            penalty = workload.repetition_penalty if i % 2 else 1.0
            params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True,
                                    repetition_penalty=penalty)
            self.ids.append(engine.add_request(prompt, params))
        self.position = dict.fromkeys(self.ids, 0)  # tokens generated so far, per request
        self.first_compressed_at: dict[str, int] = {}  # request -> position of its first compaction
        self.steps: list[StepRecord] = []
        self._logged = 0

    def step(self) -> None:
        stats = self.engine.stats
        seconds, compiles = stats.step_seconds, stats.num_compiles
        outputs = self.engine.step()
        positions = []
        for out in outputs:
            if out.error:
                raise RuntimeError(f"{self.name}: request {out.request_id} failed: {out.error}")
            (completion,) = out.outputs
            start = self.position[out.request_id]
            n = len(completion.delta_token_ids)
            positions.extend(range(start, start + n))
            self.position[out.request_id] = start + n
            if completion.metrics["num_compressions"] and out.request_id not in self.first_compressed_at:
                self.first_compressed_at[out.request_id] = start
        if positions:
            window = int(statistics.median(positions)) // self.workload.window
        else:
            window = self.steps[-1].window if self.steps else 0
        self.steps.append(StepRecord(window, stats.step_seconds - seconds, self.engine.last_step_host_seconds,
                                     len(positions), stats.num_compiles - compiles,
                                     self.engine.get_stats().num_running))
        per_window = self.workload.requests * self.workload.window
        if self.log and self.generated // per_window > self._logged:
            self._logged = self.generated // per_window
            self.log(f"{self.name}: {self.generated} tokens generated, {len(self.steps)} steps")

    def end_turn(self) -> None:
        """The wait for the device at the end of a turn belongs to the turn's last step."""
        waited = self.wait_for_device()
        if self.steps:
            self.steps[-1].seconds += waited

    def first_full_window(self) -> int | None:
        """The first window starting after every request's first compaction (None: none compressed)."""
        if len(self.first_compressed_at) < len(self.ids):
            return None
        return max(self.first_compressed_at.values()) // self.workload.window + 1

    def summary(self, first_full_window: int | None) -> dict:
        wrong = {p for p in self.position.values() if p != self.workload.max_tokens}
        if wrong:
            raise RuntimeError(f"{self.name}: expected {self.workload.max_tokens} tokens per request, got {wrong}")
        if self.engine.block_manager.num_free_blocks != self.engine.block_manager.num_usable_blocks:
            raise RuntimeError(f"{self.name}: KV blocks leaked after the run")
        windows = [[s for s in self.steps if s.window == k] for k in range(self.workload.num_windows)]

        def per_window(fn):
            return [fn(steps) if steps else None for steps in windows]

        seconds = sum(s.seconds for s in self.steps)
        stats = self.engine.get_stats()
        return {
            "step_ms_by_window": per_window(lambda st: 1e3 * statistics.median(s.seconds for s in st)),
            "host_ms_by_window": per_window(lambda st: 1e3 * statistics.median(s.host_seconds for s in st)),
            "tokens_per_s_by_window": per_window(lambda st: sum(s.tokens for s in st) / sum(s.seconds for s in st)),
            "compiles_by_window": per_window(lambda st: sum(s.compiles for s in st)),
            "steps_by_window": per_window(len),
            "first_full_window": first_full_window,
            "compiles_after_warmup": self.num_compiles,
            "host_share": sum(s.host_seconds for s in self.steps) / seconds,
            "preemptions": stats.num_preemptions,
            "compressions": stats.num_compressions,
            "tokens_per_s": sum(s.tokens for s in self.steps) / seconds,
            "output_tokens": sum(s.tokens for s in self.steps),
            "seconds": seconds,
            "steps": len(self.steps),
            "mean_running": statistics.fmean(s.running for s in self.steps),
            "peak_running": max(s.running for s in self.steps),
        }


def goals(compressed: dict) -> dict:
    """The mission's goals, on the compressed run."""
    k = compressed["first_full_window"]
    steps = compressed["step_ms_by_window"]
    ratio = None if k is None or steps[k] is None else steps[-1] / steps[k]
    return {
        "last_vs_first_full_window": ratio,
        "flat_step_time": ratio is not None and abs(ratio - 1) <= FLAT_TOLERANCE,
        "no_compiles_after_warmup": compressed["compiles_after_warmup"] == 0,
        "host_share_at_most_10pct": compressed["host_share"] <= HOST_SHARE_GOAL,
    }


def run(workload: LongWorkload, model: str = "default", options: dict | None = None, loaded=None, log=None) -> dict:
    """Both runs, interleaved; returns the summary dict."""
    from zipage_jax.engine.llm_engine import LLMEngine
    from zipage_jax.models.loading import load_model

    load_start = os.getloadavg()
    wall = time.perf_counter()
    options = dict(options or {})
    kv_cache_dtype = options.pop("kv_cache_dtype", "auto")
    pooled = workload.pool_workload()
    pooled.check()
    loaded = loaded or load_model(model, dtype=options.get("dtype"))
    pool = bt.size_pools(pooled, loaded, [kv_cache_dtype], options.get("tensor_parallel_size", 1))[kv_cache_dtype]
    prompts = bt.make_prompts(loaded.tokenizer, pooled)
    runs, warm = [], {}
    for name, compressed in (("compressed", True), ("full", False)):
        engine = LLMEngine(bt.engine_config(model, pooled, compressed, options, pool, scoring={}), loaded=loaded)
        warm[name] = bt.warm_up(engine)
        if log:
            log(f"{name}: warm-up {warm[name]['warmup_seconds']:.1f}s "
                f"({warm[name]['warmup_programs_compiled']} programs compiled)")
        runs.append(WindowedRun(name, engine, prompts, workload, log))
    bt.drive(runs, interleave=True)
    first_full = runs[0].first_full_window()
    rows = {run.name: {**run.summary(first_full), **warm[run.name]} for run in runs}
    return {
        **rows,
        "goals": goals(rows["compressed"]),
        "budget_tokens": workload.budget_tokens,
        "window": workload.window,
        "pool": pool.as_dict(),
        "model": str(loaded.source),
        "options": options,
        "policy": runs[0].engine.config.eviction_policy,
        "workload": asdict(workload),
        "seconds": time.perf_counter() - wall,
        "load_average_start": load_start,
        "run": run_info(),  # its load_average is the one at the end
    }


def format_windows(name: str, row: dict, window: int) -> str:
    lines = [f"{name}: {row['tokens_per_s']:.1f} tok/s, host share {100 * row['host_share']:.1f}%, "
             f"{row['compiles_after_warmup']} compiles after warm-up, {row['preemptions']} preemptions, "
             f"running mean {row['mean_running']:.2f} peak {row['peak_running']}",
             f"{'window':>8} {'tokens':>12} {'steps':>6} {'step ms':>9} {'host ms':>8} {'tok/s':>8} {'compiles':>8}"]
    for k, step_ms in enumerate(row["step_ms_by_window"]):
        mark = "*" if k == row["first_full_window"] else " "
        span = f"{k * window}-{(k + 1) * window - 1}"
        if step_ms is None:
            lines.append(f"{k:>7}{mark} {span:>12} {0:>6}")
            continue
        lines.append(f"{k:>7}{mark} {span:>12} {row['steps_by_window'][k]:>6} {step_ms:>9.1f} "
                     f"{row['host_ms_by_window'][k]:>8.2f} {row['tokens_per_s_by_window'][k]:>8.1f} "
                     f"{row['compiles_by_window'][k]:>8}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    from zipage_jax.cli_options import add_engine_arguments, engine_options

    parser = bt.workload_parser(__doc__, "the small preset (under 10 minutes on a 2-core CPU)")
    parser.add_argument("--budget", type=int, help="KV tokens kept per compressed sequence (whole blocks)")
    parser.add_argument("--window", type=int, help="generated tokens per window (default 512)")
    parser.add_argument("--repetition-penalty", type=float, help="of every other request (default 1.1)")
    add_engine_arguments(parser)  # --model, --kvcache-block-size, --num-kvcache-blocks, --kv-cache-dtype ...
    args = parser.parse_args(argv)
    options = engine_options(args)
    for name in ("max_cache_blocks_per_seq", "kvcache_memory_gb"):
        if name in options:
            parser.error(f"--{name.replace('_', '-')}: the budget is --budget (tokens), the pool --num-kvcache-blocks")
    if not options.pop("warmup", True):
        parser.error("--no-warmup: the windows must not hold compile time; both engines always warm up first")
    preset = PRESETS["quick" if args.quick else "default"]
    overrides = {
        **bt.workload_overrides(args),
        "budget_tokens": args.budget,
        "window": args.window,
        "repetition_penalty": args.repetition_penalty,
        "block_size": options.pop("kvcache_block_size", None),
        "pool_blocks": options.pop("num_kvcache_blocks", None),
    }
    workload = LongWorkload(**{**asdict(preset), **{k: v for k, v in overrides.items() if v is not None}})
    model = options.pop("model", None) or "default"
    return args, workload, model, options


def main(argv: list[str] | None = None) -> int:
    args, workload, model, options = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"workload: {workload.requests} requests, prompts {workload.prompt_len_min}-{workload.prompt_len_max} "
        f"tokens, {workload.max_tokens} generated each (every other one with repetition penalty "
        f"{workload.repetition_penalty}), budget {workload.budget_tokens} tokens, windows of {workload.window}; "
        f"load average {os.getloadavg()[0]:.2f}")
    summary = run(workload, model, options, log=log)
    p = summary["pool"]
    log(f"pool: {p['blocks']} blocks of {p['block_size']} tokens ({p['kv_dtype']}, {p['block_bytes']} bytes each, "
        f"{p['bytes'] / 2**20:.1f} MiB) for both runs; policy {summary['policy']}")
    for name in ("compressed", "full"):
        log(format_windows(name, summary[name], workload.window))
    log(f"goals: {json.dumps(summary['goals'])}; load average {summary['load_average_start'][0]:.2f} -> "
        f"{summary['run']['load_average'][0]:.2f}; {summary['seconds']:.0f}s in all")
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
