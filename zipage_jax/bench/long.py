"""Long generations on one KV pool: step time (host and device), and compiles per window of
generated tokens, with a KV budget and with full KV side by side, repeated to measure the noise.

    zipage-jax bench long [--preset attention | default-4k | quick | default] [--quick] [--json] [--out PATH]
        [--repeats K] [--model default | random-qwen3 | random-qwen3-tiny | PATH] [--requests 32]
        [--max-tokens 4096] [--budget 256] [--window 512] [--prompt-len 64 256] [--repetition-penalty 1.1]
        [engine options, e.g. --kv-cache-dtype int8]
    zipage-jax bench long --resummarize saved.json [--json]

Workload: N requests, prompts cut from the standard library's argparse.py (no shared prefixes),
each generating --max-tokens tokens greedily with EOS ignored; every other request has a
repetition penalty. Two engines share the loaded model and one pool of the same number of
blocks, so the same bytes: "compressed" keeps --budget tokens per sequence (the engine's default
policy and scoring; engine options such as --eviction-policy change them; with --auto-budget an
automatic budget, --budget its ceiling beside the prompt it keeps whole unless
--no-auto-budget-keeps-prompt), "full" keeps every token. The pool is either what
compression needs to hold all N at once, N * (budget / block + 1) + 1 blocks, so full KV holds
fewer and preempts or queues the rest (presets default, quick), or
what full KV needs to hold all N to the end, N * ceil((longest prompt + max tokens) / block) + 1
blocks (`pool_holds_full_kv`: presets attention, default-4k), so full KV never preempts and its
step time shows what attention over a growing context costs.

Both engines first compile every program they can reach (`LLMEngine.warmup`, untimed, once);
then each repeat (--repeats K) adds the N requests to both engines again and steps them
interleaved in turns of 16 steps, the engine with fewer generated tokens taking the next turn
(as in `zipage-jax bench throughput`), so both see the same load on a shared machine; a turn ends with a
wait for the engine's dispatched work, added to its last step. Every repeat runs the same prompts
on the same (warm) engines, so prefix caching is off unless --enable-prefix-caching is given
(a repeat would otherwise find the previous one's prompts cached and skip their prefill).

Windows are positions in each request's generation: window k holds tokens [k W, (k+1) W) of
every request (W = --window). A step belongs to the window of the median position of the
tokens it hands back; a step that hands back none (a prefill, a compaction) belongs to the
window of the step before it. Under compression every request advances in lockstep, so a
window is also the run's k-th N * W tokens. Per step: its time (EngineStats.step_seconds), its
host time (`engine.last_step_host_seconds`: step time less the wait for the device) and its
device time (step - host: the wait for the device, with the end-of-turn wait). Per window and
repeat: the median over the window's steps of each, the mean step time (with the compaction
steps the median skips), tokens/s (the tokens its steps handed back over their time) and
compiles. Per window over the K repeats: the median of those and their spread (min, max).

`first_full_window` is the first window that starts after every request's first compaction (the
position where its output metrics first count a compression; the latest over the repeats); the
full KV run reports the compressed run's index so that the windows line up. Each engine's
`last_vs_first_full_window` is the last window's median step time over first_full_window's,
on the medians over the repeats; `..._by_repeat` is the same ratio in each repeat and
`..._spread` their max - min. Goals, in "goals":
  flat_step_time      the compressed ratio <= 1 + FLAT_TOLERANCE (1.10)
  discriminated       the full KV ratio exceeds the compressed one by more than the spreads that
                      face each other: every repeat's full KV ratio above every repeat's
                      compressed one (the two ranges do not overlap), so the benchmark tells
                      compression from full KV (with one repeat this says nothing about the noise)
  flat_and_discriminated   both
  margin_over_both_spreads  the stricter reading: full ratio - compressed ratio - (both whole
                      spreads); > 0 when the medians are apart by more than both ranges
  compressed_spread_within_tolerance  whether the run's noise can settle flatness at all (the
                      compressed ratio's spread <= FLAT_TOLERANCE)
  compressed_growth   whether the compressed ratio - 1 is beyond its spread, and the change from
                      first_full_window to the last window of the host and device medians (ms):
                      `grows_in` names the larger ("host" or "device") when it grows
  no_compiles_after_warmup, host_share_at_most_10pct (host time / step time of the compressed run)
and two estimates that a loaded machine disturbs less: the ratios on each window's fastest
repeat (`..._of_min`: interference only adds time), and `full_over_compressed_by_window`, full
KV's step over the compressed one's in the same repeat and window (the turns interleave, so the
two saw the same load), with its last / first_full_window ratio.

The last line of --json is one JSON object: for "compressed" and "full" the per-window lists
(step_ms_by_window, step_ms_min_by_window, step_ms_max_by_window, the same for host_ms_ and
device_ms_, step_ms_mean_by_window, tokens_per_s_by_window: medians over the repeats;
compiles_by_window and steps_by_window: sums), the ratios above, totals over the repeats
(compiles_after_warmup, preemptions, compressions, tokens_per_s, host_share, ...), and
"repeats": each repeat's own lists and totals; then "goals", the pool (blocks, bytes per block),
the model (and "model_config" for a random one), the workload, the machine's load average at
the start, "run_start" (the run record at the start: the commit measured) and "run" (the
same at the end: commit, date, load average at the end).

Models: a name or path `load_model` knows ("default": SmolLM2-135M), or a random-initialised
Qwen3-shaped model with a byte tokenizer (zipage_jax/models/random_model.py; nothing is
downloaded): "random-qwen3" (RANDOM_MODELS: 4 layers, 8 query / 2 KV
heads, head dim 64, hidden 512, MLP 1024, vocabulary 256), small enough that attention over a
long context dominates its step on a CPU (full KV, 8 rows, 2 shared cores: 4-8 ms a step at 256
tokens of context, 30-75 ms at 8,192; hidden 768 / MLP 2048 was 16 ms at 256), and
"random-qwen3-tiny" for plumbing tests. --resummarize FILE recomputes a saved run's aggregates
and goals from its repeats (nothing runs).

Presets (--preset, --quick = --preset quick; flags override their fields):
  attention   the discriminating one: 8 requests x 8,192 tokens on random-qwen3, block 16, budget
              256, windows of 512, a pool that holds full KV (4,129 blocks, 258 MiB), 3 repeats
              (22 minutes on a loaded 2-core CPU: warm-up 3, each repeat 5-7, the full KV run
              most of it)
  default-4k  the default model at 4,096 tokens: 4 requests, block 64, budget 256, a pool that
              holds full KV, 1 repeat (on a CPU the 135M model's matmuls hide attention)
  quick       2 requests x 2,048 tokens, block 64, budget 256, a pool of 35 blocks in which full
              KV holds both requests up to about 1,000 tokens each and one after that (about 10
              minutes on the 2-core CPU with the default model, its programs already compiled)
  default     the mission's workload: 32 requests x 4,096 tokens (a GPU run; hours on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

from zipage_jax.bench.stepping import EngineRun, drive, warm_up
from zipage_jax.bench.workload import (
    Workload,
    add_workload_arguments,
    engine_config,
    make_prompts,
    size_pools,
    workload_overrides,
)
from zipage_jax.harness import add_output_arguments, emit, log, run_record, usage_error
from zipage_jax.models.random_model import RANDOM_MODELS

FLAT_TOLERANCE = 0.10  # the compressed run's last window within 10% of its first full window
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
    pool_blocks: int | None = None  # None: see pool_holds_full_kv
    # with pool_blocks None: True, N * ceil((prompt_len_max + max_tokens) / block) + 1 (full KV holds every
    # request to its end); False, what compression needs, N * (budget / block + 1) + 1
    pool_holds_full_kv: bool = False
    repeats: int = 1
    model: str = "default"  # a load_model name or path, or a RANDOM_MODELS name
    seed: int = 0

    def pool_workload(self) -> Workload:
        """The same requests as `bench throughput`'s workload (prompts, pool sizing and checks)."""
        if self.budget_tokens < self.block_size or self.budget_tokens % self.block_size:
            raise ValueError(f"the budget ({self.budget_tokens} tokens) must be a multiple of the block size "
                             f"({self.block_size})")
        if self.window < 1:
            raise ValueError(f"the window must be >= 1 token, got {self.window}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        pool = self.pool_blocks
        if pool is None and self.pool_holds_full_kv:
            pool = self.requests * -(-(self.prompt_len_max + self.max_tokens) // self.block_size) + 1
        return Workload(requests=self.requests, prompt_len_min=self.prompt_len_min,
                           prompt_len_max=self.prompt_len_max, max_tokens=self.max_tokens,
                           block_size=self.block_size, budget_blocks=self.budget_tokens // self.block_size,
                           pool_blocks=pool, seed=self.seed)

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
    # the default model at 4k tokens, full KV never preempted
    "default-4k": LongWorkload(requests=4, prompt_len_min=32, prompt_len_max=64, max_tokens=4096, block_size=64,
                               budget_tokens=256, pool_holds_full_kv=True),
    # where attention dominates the step on a CPU: full KV grows with the context, compression must not
    "attention": LongWorkload(requests=8, prompt_len_min=32, prompt_len_max=64, max_tokens=8192, block_size=16,
                              budget_tokens=256, pool_holds_full_kv=True, repeats=3, model="random-qwen3"),
}


@dataclass
class StepRecord:
    window: int
    seconds: float  # step() wall time (EngineStats.step_seconds), plus the wait at the end of a turn
    host_seconds: float  # of which host work (engine.last_step_host_seconds); the rest is device time
    tokens: int  # generated tokens the step handed back
    compiles: int
    running: int


class WindowedRun(EngineRun):
    """One engine through one repeat of the workload, one step at a time, each step recorded in its window."""

    def __init__(self, name: str, engine, prompts: list[list[int]], workload: LongWorkload, log=None):
        from zipage_jax import SamplingParams

        super().__init__(name, engine)
        self.workload, self.log = workload, log
        stats = engine.get_stats()
        self.preemptions_at_start, self.compressions_at_start = stats.num_preemptions, stats.num_compressions
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

    @property
    def generated(self) -> int:
        """Tokens this repeat has generated (the engine's count runs on over the repeats)."""
        return sum(self.position.values())

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

    def summary(self) -> dict:
        """This repeat's per-window lists and totals."""
        wrong = {p for p in self.position.values() if p != self.workload.max_tokens}
        if wrong:
            raise RuntimeError(f"{self.name}: expected {self.workload.max_tokens} tokens per request, got {wrong}")
        stats = self.engine.get_stats()
        if stats.num_free_blocks != stats.num_kv_blocks:
            raise RuntimeError(f"{self.name}: KV blocks leaked after the run")
        windows = [[s for s in self.steps if s.window == k] for k in range(self.workload.num_windows)]

        def per_window(fn):
            return [fn(steps) if steps else None for steps in windows]

        def median_ms(value):
            return per_window(lambda st: 1e3 * statistics.median(value(s) for s in st))

        seconds = sum(s.seconds for s in self.steps)
        return {
            "step_ms_by_window": median_ms(lambda s: s.seconds),
            "host_ms_by_window": median_ms(lambda s: s.host_seconds),
            "device_ms_by_window": median_ms(lambda s: s.seconds - s.host_seconds),
            "step_ms_mean_by_window": per_window(lambda st: 1e3 * statistics.fmean(s.seconds for s in st)),
            "tokens_per_s_by_window": per_window(lambda st: sum(s.tokens for s in st) / sum(s.seconds for s in st)),
            "compiles_by_window": per_window(lambda st: sum(s.compiles for s in st)),
            "steps_by_window": [len(st) for st in windows],
            "first_full_window": self.first_full_window(),
            "compiles_after_warmup": self.num_compiles,
            "host_seconds": sum(s.host_seconds for s in self.steps),
            "preemptions": stats.num_preemptions - self.preemptions_at_start,
            "compressions": stats.num_compressions - self.compressions_at_start,
            "output_tokens": sum(s.tokens for s in self.steps),
            "seconds": seconds,
            "steps": len(self.steps),
            "mean_running": statistics.fmean(s.running for s in self.steps),
            "peak_running": max(s.running for s in self.steps),
        }


def ratio(values: list, first: int | None) -> float | None:
    """The last window's value over window `first`'s (None where either is missing)."""
    if first is None or first >= len(values) or values[first] is None or values[-1] is None:
        return None
    return values[-1] / values[first]


def aggregate(repeats: list[dict], first_full: int | None) -> dict:
    """One engine's repeats: per window the median and spread (min, max) over the repeats, the
    last / first-full-window ratios, and totals."""
    def across(key: str, fn) -> list:
        out = []
        for values in zip(*(r[key] for r in repeats), strict=True):
            present = [v for v in values if v is not None]
            out.append(fn(present) if present else None)
        return out

    row = {}
    for kind in ("step", "host", "device"):
        key = f"{kind}_ms_by_window"
        row[key] = across(key, statistics.median)
        row[f"{kind}_ms_min_by_window"] = across(key, min)
        row[f"{kind}_ms_max_by_window"] = across(key, max)
    row["step_ms_mean_by_window"] = across("step_ms_mean_by_window", statistics.median)
    row["tokens_per_s_by_window"] = across("tokens_per_s_by_window", statistics.median)
    row["compiles_by_window"] = across("compiles_by_window", sum)
    row["steps_by_window"] = across("steps_by_window", sum)
    by_repeat = [ratio(r["step_ms_by_window"], first_full) for r in repeats]
    known = [x for x in by_repeat if x is not None]
    seconds = sum(r["seconds"] for r in repeats)
    tokens = sum(r["output_tokens"] for r in repeats)
    steps = sum(r["steps"] for r in repeats)
    row.update({
        "first_full_window": first_full,
        "last_vs_first_full_window": ratio(row["step_ms_by_window"], first_full),
        "last_vs_first_full_by_repeat": by_repeat,
        "last_vs_first_full_spread": max(known) - min(known) if known else None,
        "mean_last_vs_first_full_window": ratio(row["step_ms_mean_by_window"], first_full),
        "last_vs_first_full_window_of_min": ratio(row["step_ms_min_by_window"], first_full),
        "compiles_after_warmup": sum(r["compiles_after_warmup"] for r in repeats),
        "host_share": sum(r["host_seconds"] for r in repeats) / seconds,
        "preemptions": sum(r["preemptions"] for r in repeats),
        "compressions": sum(r["compressions"] for r in repeats),
        "tokens_per_s": tokens / seconds,
        "output_tokens": tokens,
        "seconds": seconds,
        "steps": steps,
        "mean_running": sum(r["mean_running"] * r["steps"] for r in repeats) / steps,
        "peak_running": max(r["peak_running"] for r in repeats),
        "repeats": repeats,
    })
    return row


def paired(compressed: dict, full: dict) -> list:
    """Per window, full KV's median step over the compressed run's in the same repeat (the two are
    interleaved, so both saw the same machine load), the median over the repeats."""
    out = []
    for k in range(len(full["step_ms_by_window"])):
        ratios = [f["step_ms_by_window"][k] / c["step_ms_by_window"][k]
                  for c, f in zip(compressed["repeats"], full["repeats"], strict=True)
                  if c["step_ms_by_window"][k] and f["step_ms_by_window"][k]]
        out.append(statistics.median(ratios) if ratios else None)
    return out


def goals(compressed: dict, full: dict) -> dict:
    """The mission's goals on the compressed run, and whether full KV differs from it beyond the noise."""
    k = compressed["first_full_window"]
    c_ratio, f_ratio = compressed["last_vs_first_full_window"], full["last_vs_first_full_window"]
    c_spread, f_spread = compressed["last_vs_first_full_spread"], full["last_vs_first_full_spread"]
    c_reps = [x for x in compressed["last_vs_first_full_by_repeat"] if x is not None]
    f_reps = [x for x in full["last_vs_first_full_by_repeat"] if x is not None]
    flat = c_ratio is not None and c_ratio <= 1 + FLAT_TOLERANCE
    # full KV's ratio above the compressed one by more than the spreads that face each other: the
    # lowest repeat's full ratio above the highest repeat's compressed one (the ranges do not overlap)
    discriminated = bool(c_reps and f_reps) and min(f_reps) > max(c_reps)
    margin = None if None in (c_ratio, f_ratio, c_spread, f_spread) else f_ratio - c_ratio - (c_spread + f_spread)
    growth = None
    if c_ratio is not None:
        host, device = compressed["host_ms_by_window"], compressed["device_ms_by_window"]
        change = {"host_ms_change": host[-1] - host[k], "device_ms_change": device[-1] - device[k]}
        beyond = c_ratio - 1 > (c_spread or 0.0)
        growth = {"beyond_spread": beyond, **change,
                  "grows_in": max(("host", "device"), key=lambda n: change[f"{n}_ms_change"]) if beyond else None}
    pairs = paired(compressed, full)
    return {
        "flat_tolerance": FLAT_TOLERANCE,
        "last_vs_first_full_window": c_ratio,  # the compressed run's (as before the repeats)
        "compressed_last_vs_first_full": c_ratio,
        "compressed_ratio_spread": c_spread,
        "full_last_vs_first_full": f_ratio,
        "full_ratio_spread": f_spread,
        "repeats": len(compressed["repeats"]),
        "flat_step_time": flat,
        "discriminated": discriminated,
        "flat_and_discriminated": bool(flat and discriminated),
        # the stricter reading: the medians apart by more than both ratios' whole spreads (> 0)
        "margin_over_both_spreads": margin,
        # whether this run's noise can settle flatness at all: the compressed ratio's spread within the tolerance
        "compressed_spread_within_tolerance": c_spread is not None and len(c_reps) > 1 and c_spread <= FLAT_TOLERANCE,
        "compressed_growth": growth,
        # estimates less sensitive to the machine's load: the ratios on the fastest repeat of each window
        # (interference only adds time), and full KV over compressed in the same repeat and window
        "compressed_last_vs_first_full_of_min": compressed["last_vs_first_full_window_of_min"],
        "full_last_vs_first_full_of_min": full["last_vs_first_full_window_of_min"],
        "full_over_compressed_by_window": pairs,
        "full_over_compressed_last_vs_first_full": ratio(pairs, k),
        "no_compiles_after_warmup": compressed["compiles_after_warmup"] == 0,
        "host_share_at_most_10pct": compressed["host_share"] <= HOST_SHARE_GOAL,
    }


def summarize_repeats(repeats: dict[str, list[dict]], warm: dict[str, dict]) -> dict:
    """{"compressed": ..., "full": ..., "goals": ...} from each engine's repeat summaries."""
    firsts = [rep["first_full_window"] for rep in repeats["compressed"]]
    first_full = None if None in firsts else max(firsts)
    rows = {name: {**aggregate(reps, first_full), **warm[name]} for name, reps in repeats.items()}
    return {**rows, "goals": goals(rows["compressed"], rows["full"])}


def resummarize(summary: dict) -> dict:
    """A saved run's summary with its aggregates and goals computed again from its repeats (by this
    version of the benchmark: "resummarized" holds its run record; "run" stays the measurement's)."""
    repeats = {name: summary[name]["repeats"] for name in ("compressed", "full")}
    warm = {name: {k: summary[name][k] for k in ("warmup_seconds", "warmup_programs_compiled")}
            for name in repeats}
    return {**summary, **summarize_repeats(repeats, warm), "resummarized": run_record()}


def load(model: str, dtype: str | None):
    """The model: what load_model loads (a RANDOM_MODELS name: random weights, byte tokenizer)."""
    from zipage_jax.models.loading import load_model

    return load_model(model, dtype=dtype)


def run_long(workload: LongWorkload, model: str | None = None, options: dict | None = None, loaded=None,
             log=None) -> dict:
    """Both engines, warmed once, through `workload.repeats` interleaved repeats; returns the summary dict."""
    from zipage_jax.engine.llm_engine import LLMEngine

    load_start = os.getloadavg()
    start_info = run_record()  # the code measured: the commit may move on while a long run runs
    wall = time.perf_counter()
    model = model or workload.model
    options = {"enable_prefix_caching": False, **(options or {})}  # every repeat runs the same prompts
    kv_cache_dtype = options.pop("kv_cache_dtype", "auto")
    pooled = workload.pool_workload()
    pooled.check()
    loaded = loaded or load(model, options.get("dtype"))
    pool = size_pools(pooled, loaded, [kv_cache_dtype], options.get("tensor_parallel_size", 1))[kv_cache_dtype]
    prompts = make_prompts(loaded.tokenizer, pooled)
    engines, warm = {}, {}
    for name, compressed in (("compressed", True), ("full", False)):
        engines[name] = LLMEngine(engine_config(model, pooled, compressed, options, pool, scoring={}),
                                  loaded=loaded)
        warm[name] = warm_up(engines[name])
        if log:
            log(f"{name}: warm-up {warm[name]['warmup_seconds']:.1f}s "
                f"({warm[name]['warmup_programs_compiled']} programs compiled)")
    repeats = []
    for r in range(workload.repeats):
        if log and workload.repeats > 1:
            log(f"repeat {r + 1} of {workload.repeats}")
        runs = [WindowedRun(name, engine, prompts, workload, log) for name, engine in engines.items()]
        drive(runs, interleave=True)
        repeats.append({run.name: run.summary() for run in runs})  # before the next repeat moves the stats on
    summary = {
        **summarize_repeats({name: [rep[name] for rep in repeats] for name in engines}, warm),
        "budget_tokens": workload.budget_tokens,
        "window": workload.window,
        "pool": pool.as_dict(),
        "model": str(loaded.source),
        "options": options,
        "policy": engines["compressed"].config.eviction_policy,
        "workload": {**asdict(workload), "model": model},
        "seconds": time.perf_counter() - wall,
        "load_average_start": load_start,
        "run_start": start_info,
        "run": run_record(),  # its load_average is the one at the end
    }
    if model in RANDOM_MODELS:
        summary["model_config"] = {k: v for k, v in RANDOM_MODELS[model].items() if k != "rope_scaling"}
    return summary


def _spread(row: dict, kind: str, k: int) -> str:
    med = row[f"{kind}_ms_by_window"][k]
    lo, hi = row[f"{kind}_ms_min_by_window"][k], row[f"{kind}_ms_max_by_window"][k]
    return f"{med:>8.2f} [{lo:.2f}-{hi:.2f}]"


def format_windows(name: str, row: dict, window: int) -> str:
    reps = len(row["repeats"])
    c = row["last_vs_first_full_window"]
    lines = [f"{name}: {row['tokens_per_s']:.1f} tok/s, host share {100 * row['host_share']:.1f}%, "
             f"{row['compiles_after_warmup']} compiles after warm-up, {row['preemptions']} preemptions, "
             f"running mean {row['mean_running']:.2f} peak {row['peak_running']}; {reps} repeat(s); last / first "
             f"full window {'-' if c is None else f'{c:.3f}'} (by repeat "
             f"{', '.join('-' if x is None else f'{x:.3f}' for x in row['last_vs_first_full_by_repeat'])})",
             "  step, host, device: median over the repeats of each window's median per step [min-max], ms",
             f"{'window':>8} {'tokens':>12} {'steps':>6} {'step ms':>24} {'host ms':>24} {'device ms':>24} "
             f"{'mean ms':>8} {'tok/s':>8} {'compiles':>8}"]
    for k, step_ms in enumerate(row["step_ms_by_window"]):
        mark = "*" if k == row["first_full_window"] else " "
        span = f"{k * window}-{(k + 1) * window - 1}"
        if step_ms is None:
            lines.append(f"{k:>7}{mark} {span:>12} {0:>6}")
            continue
        lines.append(f"{k:>7}{mark} {span:>12} {row['steps_by_window'][k]:>6} {_spread(row, 'step', k):>24} "
                     f"{_spread(row, 'host', k):>24} {_spread(row, 'device', k):>24} "
                     f"{row['step_ms_mean_by_window'][k]:>8.2f} {row['tokens_per_s_by_window'][k]:>8.1f} "
                     f"{row['compiles_by_window'][k]:>8}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zipage_jax.cli_options import add_engine_arguments

    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    add_workload_arguments(parser, "the quick preset (--preset quick)")
    add_output_arguments(parser)
    parser.add_argument("--preset", choices=list(PRESETS), help="the workload (default: default)")
    parser.add_argument("--repeats", type=int, help="interleaved runs of both engines (default: the preset's)")
    parser.add_argument("--budget", type=int, help="KV tokens kept per compressed sequence (whole blocks)")
    parser.add_argument("--window", type=int, help="generated tokens per window (default 512)")
    parser.add_argument("--repetition-penalty", type=float, help="of every other request (default 1.1)")
    parser.add_argument("--resummarize", metavar="FILE",
                        help="run nothing: recompute the aggregates and goals of FILE's last JSON line "
                             "from its repeats")
    add_engine_arguments(parser)  # --model, --kvcache-block-size, --num-kvcache-blocks, --kv-cache-dtype ...


def settings(args: argparse.Namespace) -> tuple[LongWorkload, dict]:
    """The workload (its model among its fields) and the other engine options of the flags; a usage
    error for flags that do not go together."""
    from zipage_jax.cli_options import engine_options

    options = engine_options(args)
    for name in ("max_cache_blocks_per_seq", "kvcache_memory_gb"):
        if name in options:
            usage_error("bench long", f"--{name.replace('_', '-')}: the budget is --budget (tokens), the pool "
                                      "--num-kvcache-blocks")
    if not options.pop("warmup", True):
        usage_error("bench long", "--no-warmup: the windows must not hold compile time; both engines always warm up "
                                  "first")
    if args.quick and args.preset not in (None, "quick"):
        usage_error("bench long", f"--quick is --preset quick, not --preset {args.preset}")
    if args.repeats is not None and args.repeats < 1:
        usage_error("bench long", "--repeats must be >= 1")
    preset = PRESETS["quick" if args.quick else args.preset or "default"]
    overrides = {
        **workload_overrides(args),
        "budget_tokens": args.budget,
        "window": args.window,
        "repetition_penalty": args.repetition_penalty,
        "repeats": args.repeats,
        "model": options.pop("model", None),
        "block_size": options.pop("kvcache_block_size", None),
        "pool_blocks": options.pop("num_kvcache_blocks", None),
    }
    workload = LongWorkload(**{**asdict(preset), **{k: v for k, v in overrides.items() if v is not None}})
    return workload, options


def report(summary: dict) -> None:
    p = summary["pool"]
    log(f"pool: {p['blocks']} blocks of {p['block_size']} tokens ({p['kv_dtype']}, {p['block_bytes']} bytes each, "
        f"{p['bytes'] / 2**20:.1f} MiB) for both runs; policy {summary['policy']}; model {summary['model']}")
    for name in ("compressed", "full"):
        log(format_windows(name, summary[name], summary["window"]))
    log(f"goals: {json.dumps(summary['goals'])}; load average {summary['load_average_start'][0]:.2f} -> "
        f"{summary['run']['load_average'][0]:.2f}; {summary['seconds']:.0f}s in all")


def run(args: argparse.Namespace) -> int:
    workload, options = settings(args)
    if args.resummarize:
        with open(args.resummarize, encoding="utf-8") as f:
            summary = resummarize(json.loads(f.read().strip().splitlines()[-1]))
        report(summary)
        return emit(summary, args)
    log(f"workload: {workload.requests} requests, prompts {workload.prompt_len_min}-{workload.prompt_len_max} "
        f"tokens, {workload.max_tokens} generated each (every other one with repetition penalty "
        f"{workload.repetition_penalty}), budget {workload.budget_tokens} tokens, windows of {workload.window}, "
        f"{workload.repeats} repeat(s), model {workload.model}; load average {os.getloadavg()[0]:.2f}")
    summary = run_long(workload, workload.model, options, log=log)
    report(summary)
    return emit(summary, args)
