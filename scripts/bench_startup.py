"""Start-up benchmark: process start to the first token, to a fully warmed engine and to a fully
warmed server, cold and warm, this tree against a baseline commit side by side.

    python scripts/bench_startup.py [--model default] [--baseline 09dcce3 | none] [--runs 3]
                                    [--skip first_token,warmup,server,qwen3_8b,baseline_no_warmup] [--json]
    python scripts/bench_startup.py --quick --model /path/to/tiny_model --baseline none --json

Every measurement runs in fresh subprocesses (a process start is part of what is measured), each
with a ZIPAGE_JAX_CACHE of its own under a temporary directory. The model is converted once per
tree (its seconds are reported under "conversion") and its converted entry (the hash-named
directory with hf_config.json) is hard-linked into every fresh cache, so "cold" means an empty
program cache, not an unconverted model; "warm" is a second process on the same cache.

Sections:
  first_token  process start -> first streamed token of LLM(model).stream(PROMPT, temperature 0,
               max_tokens 8), cold and warm; import and engine-construction seconds; the
               programs built and how (compiled, or loaded from the executable store).
  warmup       process start -> LLM(model, warmup=True) returned (the whole grid built), cold and
               warm; per kind of program (forward decode rows / prefill rows, compression,
               history) the summed trace, lower, compile and load seconds.
  server       scripts/serve_jax.py (127.0.0.1, a free port, --kvcache-block-size 32
               --max-num-seqs 64) -> seconds to /health 200, then at once 64 concurrent streaming
               /v1/completions (distinct prompts, max_tokens 16, temperature 0): TTFT p50/p90;
               then seconds until the warm-up grid is built (from /metrics), cold and warm. This
               tree runs the server's default (a background warm-up where the server has one);
               the baseline runs with --warmup, as its users did (/health waits for the whole
               grid), and once, cold, with --no-warmup ("baseline_no_warmup").
  qwen3_8b     compile figures of a Qwen3-8B-shaped model without its weights (parameters are
               ShapeDtypeStructs): a runner on CPU with a small pool builds decode rows 1 and 64,
               prefill rows 64 and the largest compression and history buckets; per program the
               trace/lower/compile seconds, the grid's size, the whole grid's build seconds
               extrapolated per kind, and the process's peak memory (no weights allocated).

Runs are interleaved: current cold, baseline cold, current warm, baseline warm, ... "current"
is a copy of this tree's zipage_jax, pallas_kernels and scripts taken at the start (untracked
files included), so an edit during the run cannot turn a warm run cold (the executable store's
key hashes the engine's source). The baseline is a `git worktree add --detach` of --baseline in
a temporary directory (removed at the end). Each tree is first on PYTHONPATH (and runs its own
scripts/serve_jax.py); both run under this Python. "goals" holds each start-up goal's value, limit and whether it is met, for
both trees. --quick (tests): one warm run, a small engine (override with --option NAME=VALUE),
8 streams of 4 tokens and a scaled-down Qwen3 shape; pass a tiny model with --model.
With --json the last line of stdout is one JSON object (with "run": run_info()); progress lines
come before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()

PROMPT = "The capital of France is"
FIRST_TOKEN_MAX_TOKENS = 8
DEFAULT_BASELINE = "09dcce3"
SECTIONS = ("first_token", "warmup", "server", "qwen3_8b", "baseline_no_warmup")
KINDS = ("forward_decode", "forward_prefill", "compression", "history")
SERVER_DEFAULTS = {"kvcache_block_size": 32, "max_num_seqs": 64}  # as in our other server runs
STREAMS, STREAM_TOKENS = 64, 16
QUICK_OPTIONS = {"max_num_seqs": 2, "max_num_batched_tokens": 32, "kvcache_block_size": 16,
                 "num_kvcache_blocks": 32, "max_model_len": 64, "max_compress_seqs": 1}
QUICK_STREAMS, QUICK_STREAM_TOKENS = 8, 4
# environment that would point a worker at a shared compilation cache (the baseline then skips its own)
_SHARED_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")

# Qwen3-8B's shape (the Hugging Face config's values)
QWEN3_8B = dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                max_position_embeddings=40960, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                qk_norm=True, bos_token_id=None, eos_token_ids=[151645, 151643])
QWEN3_QUICK = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
               "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "max_position_embeddings": 512}
QWEN3_OPTIONS = {"kvcache_block_size": 16, "num_kvcache_blocks": 64, "max_num_seqs": 64,
                 "max_num_batched_tokens": 2048}
QWEN3_QUICK_OPTIONS = {"kvcache_block_size": 16, "num_kvcache_blocks": 16, "max_num_seqs": 4,
                       "max_num_batched_tokens": 64, "max_compress_seqs": 1}


@dataclass(frozen=True)
class Goal:
    name: str
    limit: float  # seconds; met when value <= limit
    section: str
    phase: str  # "cold" (the one cold run) or "warm" (the median of the warm runs)
    field: str
    what: str
    require: str | None = None  # a run field that must be true as well


GOALS = (
    Goal("cold_start_to_warmed_engine_s", 90.0, "warmup", "cold", "ready_at_s",
         "process start -> LLM(model, warmup=True) returned, empty program cache"),
    Goal("cold_start_to_warmed_server_s", 90.0, "server", "cold", "grid_done_s",
         "server process start -> the whole warm-up grid built, empty program cache (baseline: /health 200 "
         "under --warmup)"),
    Goal("restart_to_first_token_s", 5.0, "first_token", "warm", "first_token_at_s",
         "process start -> first streamed token, program cache filled by an earlier process (median)"),
    Goal("restart_to_warmed_engine_s", 10.0, "warmup", "warm", "ready_at_s",
         "process start -> LLM(model, warmup=True) returned, program cache filled by an earlier process (median)"),
    Goal("restart_to_warmed_server_s", 10.0, "server", "warm", "grid_done_s",
         "server process start -> the whole warm-up grid built, program cache filled by an earlier server (median; "
         "baseline: /health 200 under --warmup)"),
    Goal("new_server_ttft_p50_s", 2.0, "server", "cold", "ttft_p50_s",
         "TTFT p50 of the concurrent new streams sent the moment a cold-started server answers /health 200 "
         "(every stream must succeed)", require="all_succeeded"),
)


# -- pure helpers -----------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linearly interpolated; None when empty."""
    data = sorted(float(v) for v in values if v is not None)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value}, the samples of one name summed over
    their labels. Comments and lines that do not parse are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line:
                name, rest = line[:line.index("{")], line[line.rindex("}") + 1:].split()
            else:
                name, *rest = line.split()
            value = float(rest[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def metric(metrics: dict[str, float] | None, name: str) -> float | None:
    """A metric by name, a counter with or without its _total suffix; None when absent."""
    if not metrics:
        return None
    for candidate in (name, name + "_total", name.removesuffix("_total")):
        if candidate in metrics:
            return metrics[candidate]
    return None


def grid_done(metrics: dict[str, float] | None) -> bool | None:
    """Whether the server's warm-up grid is built: zipage:warmup_done, else warmup_programs_ready
    (or programs_ready) >= warmup_programs_total; None when the metrics cannot tell (absent, or a
    grid of 0 programs: no warm-up)."""
    total = metric(metrics, "zipage:warmup_programs_total")
    if total is None or total <= 0:
        return None
    done = metric(metrics, "zipage:warmup_done")
    if done is not None:
        return done >= 1
    ready = metric(metrics, "zipage:warmup_programs_ready")
    if ready is None:
        ready = metric(metrics, "zipage:programs_ready")
    return None if ready is None else ready >= total


SERVER_METRICS = ("zipage:compile_seconds_total", "zipage:programs_ready", "zipage:programs_loaded_total",
                  "zipage:warmup_programs_total", "zipage:warmup_programs_ready", "zipage:warmup_programs_failed",
                  "zipage:warmup_serving_ready", "zipage:warmup_done")


def server_metric_snapshot(metrics: dict[str, float] | None) -> dict[str, float | None]:
    """The start-up metrics of a /metrics scrape (None for each one the server does not have)."""
    return {name: metric(metrics, name) for name in SERVER_METRICS}


def evaluate_goal(value: float | None, limit: float, ok: bool | None = True) -> dict:
    """{"value", "goal", "met"}: met is None without a value, else value <= limit (and `ok`)."""
    met = None if value is None else bool(value <= limit and ok is not False)
    return {"value": value, "goal": limit, "met": met}


def goal_value(results: dict, goal: Goal, tree: str) -> tuple[float | None, bool | None]:
    """(value, ok) of `goal` for `tree` in the results: the cold run's field or the warm runs' median."""
    per_tree = (results.get(goal.section) or {}).get(tree) or {}
    if goal.phase == "cold":
        run = per_tree.get("cold") or {}
        if not run.get("ok"):
            return None, None
        return run.get(goal.field), (None if goal.require is None else run.get(goal.require))
    warm = per_tree.get("warm") or {}
    value = (warm.get("median") or {}).get(goal.field)
    ok = None
    if goal.require is not None:
        ok = all(run.get(goal.require) for run in warm.get("runs", []))
    return value, ok


def evaluate_goals(results: dict, trees) -> dict:
    """Every goal with its limit, what it measures and, per tree (None when not run), value and met."""
    out = {}
    for goal in GOALS:
        entry = {"goal": goal.limit, "unit": "s", "what": goal.what,
                 "from": f"{goal.section}.<tree>.{goal.phase}" + (".median" if goal.phase == "warm" else "")
                 + f".{goal.field}"}
        for tree in ("current", "baseline"):
            if tree not in trees:
                entry[tree] = None
                continue
            value, ok = goal_value(results, goal, tree)
            entry[tree] = evaluate_goal(value, goal.limit, ok)
        out[goal.name] = entry
    return out


def median_fields(runs: list[dict]) -> dict:
    """The median of every numeric top-level field over the successful runs (bools excluded)."""
    ok = [r for r in runs if r.get("ok")]
    names = {k for r in ok for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out = {}
    for name in sorted(names):
        values = [r[name] for r in ok if isinstance(r.get(name), int | float) and not isinstance(r[name], bool)]
        if values:
            out[name] = statistics.median(values)
    return out


def kind_of(name: str, key) -> str:
    """The kind of a program from its shape key: forward_decode, forward_prefill, compression,
    history (else the program's name)."""
    head = key[0] if key else None
    return {"decode rows": "forward_decode", "prefill rows": "forward_prefill", "batch": "compression",
            "tokens": "history"}.get(head, name)


def _kind_row() -> dict:
    return {"programs": 0, "compiled": 0, "loaded": 0, "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0,
            "load_s": 0.0, "total_s": 0.0}


def summarize_records(records) -> dict:
    """ProgramRecords (name, key, origin, trace/lower/compile/load_seconds) -> counts by origin and,
    per kind, the programs and their summed seconds per stage."""
    by_kind: dict[str, dict] = {}
    for r in records:
        row = by_kind.setdefault(kind_of(r.name, tuple(r.key)), _kind_row())
        row["programs"] += 1
        row["compiled"] += r.origin == "compiled"
        row["loaded"] += r.origin == "loaded"
        for stage in ("trace", "lower", "compile", "load"):
            seconds = float(getattr(r, f"{stage}_seconds", 0.0) or 0.0)
            row[f"{stage}_s"] += seconds
            row["total_s"] += seconds
    return {"source": "records", "total": sum(r["programs"] for r in by_kind.values()),
            "compiled": sum(r["compiled"] for r in by_kind.values()),
            "loaded": sum(r["loaded"] for r in by_kind.values()),
            "seconds": sum(r["total_s"] for r in by_kind.values()), "by_kind": by_kind}


def summarize_compile_seconds(steps, num_compiles: int | None) -> dict:
    """A runner without records (the baseline): CompiledSteps' compile_seconds {key: seconds}
    (jit's lower, tracing included, and compile; XLA's persistent cache may have skipped the
    compile) per kind."""
    by_kind: dict[str, dict] = {}
    for s in steps:
        for key, seconds in dict(getattr(s, "compile_seconds", None) or {}).items():
            row = by_kind.setdefault(kind_of(getattr(s, "name", "?"), tuple(key)),
                                     {"programs": 0, "compiled": None, "loaded": None, "trace_s": None,
                                      "lower_s": None, "compile_s": None, "load_s": None, "total_s": 0.0})
            row["programs"] += 1
            row["total_s"] += float(seconds)
    return {"source": "compile_seconds (trace + lower + compile per program; no per-stage timing, no origin)",
            "total": num_compiles, "compiled": None, "loaded": None,
            "seconds": sum(r["total_s"] for r in by_kind.values()), "by_kind": by_kind}


def select_subset(keys) -> list[tuple]:
    """The representative programs of a grid: decode rows smallest and largest, the largest prefill
    rows, the largest compression bucket (batch x blocks) and the largest history bucket."""
    keys = [tuple(k) for k in keys]
    picked = []

    def add(key):
        if key is not None and key not in picked:
            picked.append(key)

    decode = [k for k in keys if kind_of("", k) == "forward_decode"]
    if decode:
        add(min(decode, key=lambda k: k[1]))
        add(max(decode, key=lambda k: k[1]))
    for kind in ("forward_prefill", "compression", "history"):
        of_kind = [k for k in keys if kind_of("", k) == kind]
        if of_kind:
            add(max(of_kind, key=lambda k: math.prod(k[1::2])))
    return picked


def extrapolate(grid_keys, programs: list[dict]) -> dict:
    """Per kind, the mean build seconds of the measured programs x the programs of that kind in
    the grid; None for a kind with none measured."""
    counts = Counter(kind_of("", tuple(k)) for k in grid_keys)
    per_kind = {}
    for kind, n in counts.items():
        measured = [p["build_s"] for p in programs if p["kind"] == kind and p.get("build_s") is not None]
        mean = sum(measured) / len(measured) if measured else None
        per_kind[kind] = {"grid_programs": n, "measured": len(measured), "mean_s": mean,
                          "estimated_s": None if mean is None else mean * n}
    estimates = [row["estimated_s"] for row in per_kind.values()]
    total = None if None in estimates else sum(estimates)
    return {"per_kind": per_kind, "estimated_grid_s": total}


def parse_option(text: str) -> tuple[str, object]:
    """NAME=VALUE -> (name, value): JSON when VALUE parses as JSON (4, true, null), else the string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return name.strip().replace("-", "_"), parsed


def server_flags(options: dict) -> list[str]:
    """Engine options as serve_jax.py flags (--name-with-dashes VALUE, --flag / --no-flag)."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def stream_summary(streams: list[dict]) -> dict:
    """TTFT percentiles and success counts of the concurrent streams."""
    ttfts = [s["ttft_s"] for s in streams if s.get("ok")]
    errors = sorted({s["error"] for s in streams if s.get("error")})
    return {"streams": len(streams), "succeeded": sum(bool(s.get("ok")) for s in streams),
            "all_succeeded": bool(streams) and all(s.get("ok") for s in streams),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "ttft_max_s": max(ttfts) if ttfts else None,
            "stream_seconds_p50": percentile([s.get("seconds") for s in streams if s.get("ok")], 50),
            "errors": errors[:5]}


# -- the measuring processes ------------------------------------------------------------------------


def worker_main(spec_path: str) -> int:
    """One measuring process: runs spec["kind"] and writes its result (time.time() stamps) to spec["out"]."""
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    spec["started"] = started
    result: dict = {"started": started}
    try:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        work = {"convert": _work_convert, "first_token": _work_first_token, "warmup": _work_warmup,
                "qwen3_8b": _work_qwen3}[spec["kind"]]
        result.update(work(spec))
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    Path(spec["out"]).write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


def _package_file() -> str:
    import zipage_jax

    return zipage_jax.__file__


def _work_convert(spec: dict) -> dict:
    from zipage_jax.models.loading import load_model

    start = time.perf_counter()
    loaded = load_model(spec["model"], dtype=spec["options"].get("dtype"))
    return {"seconds": time.perf_counter() - start, "load_seconds": loaded.load_seconds,
            "from_cache": loaded.from_cache, "source": str(loaded.source), "zipage_jax": _package_file()}


def program_summary(runner) -> dict:
    """How the runner's programs were built: from its records when it has them, else (the
    baseline) its CompiledSteps' compile_seconds and num_compiles."""
    records = getattr(runner, "records", None)
    if records is not None:
        return summarize_records(records)
    steps = [s for s in (getattr(runner, n, None) for n in ("forward", "compressor", "seeder")) if s is not None]
    return summarize_compile_seconds(steps, getattr(runner, "num_compiles", None))


def _work_first_token(spec: dict) -> dict:
    stamps = {}
    from zipage_jax import LLM, SamplingParams

    stamps["imported"] = time.time()
    llm = LLM(spec["model"], **spec["options"])
    stamps["engine_ready"] = time.time()
    runner = llm.engine.runner
    at_first, texts, tokens = None, [], 0
    for out in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=spec["max_tokens"])):
        for o in out.outputs:
            if o.delta_token_ids and "first_token" not in stamps:
                stamps["first_token"] = time.time()
                at_first = program_summary(runner)
            tokens += len(o.delta_token_ids)
            texts.append(o.delta_text)
    stamps["done"] = time.time()
    return {"stamps": stamps, "tokens": tokens, "text": "".join(texts), "programs_at_first_token": at_first,
            "programs": program_summary(runner), "zipage_jax": _package_file()}


def _work_warmup(spec: dict) -> dict:
    stamps = {}
    from zipage_jax import LLM

    stamps["imported"] = time.time()
    llm = LLM(spec["model"], **{**spec["options"], "warmup": True})
    stamps["ready"] = time.time()
    engine = llm.engine
    status = getattr(engine, "warmup_status", None)
    if status is not None:
        status = {k: getattr(status, k) for k in ("total", "ready", "serving_ready", "done", "seconds", "failed")}
    return {"stamps": stamps, "warmup_status": status, "grid_programs": len(engine.runner.step_grid()),
            "programs": program_summary(engine.runner), "zipage_jax": _package_file()}


def _grid_entry(program) -> tuple[str, tuple, object]:
    """(kind, key, build) of a grid entry: a GridProgram, or the baseline's (kind, key, build) tuple."""
    if hasattr(program, "build"):
        return program.kind, tuple(program.key), program.build
    kind, key, build = program
    return kind, tuple(key), build


def _program_seconds(runner, key: tuple) -> dict:
    """Trace/lower/compile seconds of one grid key (summed over its stages' programs), from the
    runner's records; for a runner without records its trace + lower + compile seconds."""
    records = getattr(runner, "records", None)
    if records is not None:
        mine = [r for r in records if tuple(r.key) == key]
        row = {f"{s}_s": sum(float(getattr(r, f"{s}_seconds", 0.0) or 0.0) for r in mine)
               for s in ("trace", "lower", "compile", "load")}
        row["origins"] = sorted({r.origin for r in mine})
        if len(mine) > 1:
            row["programs"] = [{"name": r.name, "trace_s": r.trace_seconds, "lower_s": r.lower_seconds,
                                "compile_s": r.compile_seconds} for r in mine]
        return row
    for steps in (getattr(runner, n, None) for n in ("forward", "compressor", "seeder")):
        seconds = dict(getattr(steps, "compile_seconds", None) or {})
        if key in seconds:
            return {"trace_s": None, "lower_s": None, "compile_s": None, "trace_lower_compile_s": seconds[key]}
    return {}


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _param_stats(runner, decoder) -> dict:
    """How many of the runner's parameters are abstract (ShapeDtypeStructs) and how many bytes are real."""
    import jax
    from flax import nnx

    params = getattr(runner, "params", None)
    leaves = jax.tree.leaves(params if params is not None else nnx.state(decoder))
    abstract = [x for x in leaves if isinstance(x, jax.ShapeDtypeStruct)]
    real = [x for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    return {"leaves": len(leaves), "abstract_leaves": len(abstract),
            "abstract_params": sum(math.prod(x.shape) for x in abstract),
            "abstract_gb": sum(math.prod(x.shape) * x.dtype.itemsize for x in abstract) / 2**30,
            "real_mb": sum(math.prod(x.shape) * x.dtype.itemsize for x in real) / 2**20}


def _work_qwen3(spec: dict) -> dict:
    stamps = {}
    import jax
    import jax.numpy as jnp

    from zipage_jax.config import EngineConfig
    from zipage_jax.engine.pool_plan import plan_pool
    from zipage_jax.engine.runner import ModelRunner
    from zipage_jax.models.config import ModelConfig
    from zipage_jax.models.decoder import Decoder
    from zipage_jax.models.loading import LoadedModel

    stamps["imported"] = time.time()
    fields = dict(spec["model_config"], eos_token_ids=tuple(spec["model_config"]["eos_token_ids"]), rope_scaling=None)
    cfg = ModelConfig(**fields)
    dtype = jnp.dtype(spec["dtype"])
    decoder = Decoder(cfg, dtype=dtype, rngs=None)  # parameters are ShapeDtypeStructs: no weights
    loaded = LoadedModel(cfg, decoder, None, "abstract Qwen3-8B shape", False, 0.0)
    config = EngineConfig(model="abstract", dtype=spec["dtype"], compilation_cache_dir="", **spec["options"])
    pool = plan_pool(config, cfg, dtype)
    runner = ModelRunner(loaded, config, pool, eos_token_ids=cfg.eos_token_ids)
    stamps["runner"] = time.time()
    before = _param_stats(runner, decoder)
    grid = [_grid_entry(p) for p in runner.step_grid()]
    keys = [key for _, key, _ in grid]
    picked = select_subset(keys)
    programs = []
    for _, key, build in grid:
        if key not in picked:
            continue
        start = time.perf_counter()
        build()
        row = {"key": list(key), "kind": kind_of("", key), "build_s": time.perf_counter() - start,
               **_program_seconds(runner, key), "peak_rss_gb": _peak_rss_gb()}
        programs.append(row)
        # so far, in case the parent's timeout ends this process before the last program
        Path(spec["out"]).write_text(json.dumps({"started": spec["started"], "stamps": stamps, "programs": programs,
                                                 "grid": {"size": len(keys)}, "partial": True}, default=str))
    stamps["built"] = time.time()
    after = _param_stats(runner, decoder)
    return {"stamps": stamps, "backend": jax.default_backend(), "pool_blocks": pool.num_blocks,
            "max_blocks_per_seq": pool.max_blocks_per_seq, "max_model_len": pool.max_model_len,
            "grid": {"size": len(keys), "by_kind": dict(Counter(kind_of("", k) for k in keys))},
            "programs": programs, "extrapolated": extrapolate(keys, programs),
            "params_before": before, "params_after": after, "peak_rss_gb": _peak_rss_gb(),
            "zipage_jax": _package_file()}


# -- the parent --------------------------------------------------------------------------------------


@dataclass
class Tree:
    name: str  # "current" or "baseline"
    root: Path
    commit: str


def _say(msg: str) -> None:
    print(msg, flush=True)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _programs_line(run: dict) -> str:
    if run.get("programs_compiled") is None:
        return f"programs {run.get('programs_total')} (origin not recorded)"
    return (f"programs {run.get('programs_total')}: compiled {run['programs_compiled']}, "
            f"loaded {run.get('programs_loaded')}")


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> dict:
    """SIGTERM, then SIGKILL after `grace` seconds; how it ended."""
    killed = False
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            killed = True
            proc.wait(30)
    return {"returncode": proc.returncode, "killed": killed}


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, trees: dict[str, Tree]):
        self.args, self.workdir, self.trees = args, workdir, trees
        self.options: dict = args.engine_options
        self.model_entries: dict[str, list[Path]] = {}
        self.conversion: dict[str, dict] = {}
        self.errors: list[str] = []
        self._counter = 0

    # -- plumbing

    def _env(self, tree: Tree, cache: Path, cpu: bool = False) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _SHARED_CACHE_VARIABLES}
        env["ZIPAGE_JAX_CACHE"] = str(cache)
        env["PYTHONPATH"] = os.pathsep.join([str(tree.root), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        if cpu:
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def _name(self, *parts: str) -> Path:
        self._counter += 1
        return self.workdir / "logs" / f"{self._counter:02d}-{'-'.join(parts)}"

    def fresh_cache(self, tree: Tree, label: str) -> Path:
        """An empty program cache holding only the tree's converted model (hard links)."""
        cache = self.workdir / tree.name / label / "cache"
        cache.mkdir(parents=True)
        for entry in self.model_entries.get(tree.name, []):
            shutil.copytree(entry, cache / entry.name, copy_function=_link_or_copy)
        return cache

    def worker(self, kind: str, tree: Tree, cache: Path, label: str, cpu: bool = False, **spec) -> dict:
        """Runs one measuring process; its result with every stamp as seconds since its start."""
        base = self._name(kind, tree.name, label)
        base.parent.mkdir(parents=True, exist_ok=True)
        spec_path, out, log = base.with_suffix(".spec.json"), base.with_suffix(".out.json"), base.with_suffix(".log")
        spec_path.write_text(json.dumps({"kind": kind, "out": str(out), "model": self.args.model,
                                         "options": self.options, **spec}))
        with log.open("w") as log_file:
            t0 = time.time()
            proc = subprocess.Popen([sys.executable, str(SCRIPT), "--worker", str(spec_path)], cwd=tree.root,
                                    env=self._env(tree, cache, cpu), stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            timed_out = False
            try:
                proc.wait(self.args.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # a timeout, or this process interrupted: the worker (in a session of its own) goes too
                if proc.poll() is None:
                    stop_process(proc, grace=10)
            exited = time.time()
        result = json.loads(out.read_text()) if out.is_file() else {}  # a timed-out worker may leave a partial one
        if timed_out:
            result.update(ok=False, error=f"timed out after {self.args.timeout:g} s")
        elif "ok" not in result:
            result.update(ok=False, error=f"exited with status {proc.returncode} without a result")
        result["returncode"] = proc.returncode
        result["exit_at_s"] = exited - t0
        result["interpreter_s"] = result.pop("started", t0) - t0
        result["at_s"] = {k: v - t0 for k, v in result.pop("stamps", {}).items()}
        imported = result.get("zipage_jax")
        if result.get("ok") and imported and not Path(imported).resolve().is_relative_to(tree.root.resolve()):
            result.update(ok=False, error=f"imported zipage_jax from {imported}, not from the {tree.name} tree "
                                          f"{tree.root}")
        if not result.get("ok"):
            result["log_tail"] = _tail(log)
            self.errors.append(f"{kind} {tree.name} {label}: {result.get('error')}")
            _say(f"  {kind} {tree.name} {label} FAILED: {result.get('error')} (log: {log})")
        return result

    def convert(self) -> None:
        """Converts the model once per tree into a cache of its own (reported under "conversion")."""
        for tree in self.trees.values():
            cache = self.workdir / tree.name / "model-cache"
            cache.mkdir(parents=True)
            result = self.worker("convert", tree, cache, "once")
            entries = sorted(p.parent for p in cache.glob("*/hf_config.json"))
            self.model_entries[tree.name] = entries
            self.conversion[tree.name] = {k: result.get(k) for k in ("ok", "seconds", "load_seconds", "from_cache",
                                                                    "source", "exit_at_s", "error")}
            self.conversion[tree.name]["entries"] = [p.name for p in entries]
            _say(f"conversion {tree.name}: {_fmt(result.get('seconds'))} s converting, process "
                 f"{_fmt(result.get('exit_at_s'))} s ({len(entries)} cached entr{'y' if len(entries) == 1 else 'ies'})")

    def interleaved(self, section: str, measure) -> dict:
        """measure(tree, cache, label) for every tree: cold on a fresh cache, then --runs warm runs on
        the same cache, current and baseline interleaved."""
        caches = {}
        out = {}
        for tree in self.trees.values():
            caches[tree.name] = self.fresh_cache(tree, section)
            out[tree.name] = {"cold": measure(tree, caches[tree.name], "cold"), "warm": {"runs": []}}
        for i in range(self.args.runs):
            for tree in self.trees.values():
                out[tree.name]["warm"]["runs"].append(measure(tree, caches[tree.name], f"warm{i + 1}"))
        for tree in self.trees.values():
            out[tree.name]["warm"]["median"] = median_fields(out[tree.name]["warm"]["runs"])
        return out

    # -- sections

    def first_token(self) -> dict:
        def measure(tree: Tree, cache: Path, label: str) -> dict:
            r = self.worker("first_token", tree, cache, label, max_tokens=FIRST_TOKEN_MAX_TOKENS)
            at = r["at_s"]
            run = {"ok": bool(r.get("ok")) and "first_token" in at, "first_token_at_s": at.get("first_token"),
                   "imported_at_s": at.get("imported"), "engine_ready_at_s": at.get("engine_ready"),
                   "done_at_s": at.get("done"), "exit_at_s": r["exit_at_s"], "interpreter_s": r["interpreter_s"]}
            if run["ok"]:
                run["import_s"] = at["imported"] - r["interpreter_s"]
                run["engine_construction_s"] = at["engine_ready"] - at["imported"]
                run["first_token_after_engine_s"] = at["first_token"] - at["engine_ready"]
            programs = r.get("programs") or {}
            run.update(programs_total=programs.get("total"), programs_compiled=programs.get("compiled"),
                       programs_loaded=programs.get("loaded"), tokens=r.get("tokens"), text=r.get("text"),
                       programs=programs, programs_at_first_token=r.get("programs_at_first_token"),
                       zipage_jax=r.get("zipage_jax"))
            self._error_fields(run, r)
            _say(f"first_token {tree.name:8s} {label:5s}: first token at {_fmt(run['first_token_at_s'])} s "
                 f"(imports {_fmt(run.get('import_s'))} s, engine {_fmt(run.get('engine_construction_s'))} s; "
                 f"{_programs_line(run)})")
            return run

        return {"prompt": PROMPT, "max_tokens": FIRST_TOKEN_MAX_TOKENS, "options": self.options,
                **self.interleaved("first_token", measure)}

    def warmup(self) -> dict:
        def measure(tree: Tree, cache: Path, label: str) -> dict:
            r = self.worker("warmup", tree, cache, label)
            at = r["at_s"]
            run = {"ok": bool(r.get("ok")), "ready_at_s": at.get("ready"), "imported_at_s": at.get("imported"),
                   "exit_at_s": r["exit_at_s"], "interpreter_s": r["interpreter_s"]}
            if run["ok"]:
                run["import_s"] = at["imported"] - r["interpreter_s"]
                run["engine_with_warmup_s"] = at["ready"] - at["imported"]
            programs = r.get("programs") or {}
            status = r.get("warmup_status")
            run.update(grid_programs=r.get("grid_programs"), warmup_seconds=(status or {}).get("seconds"),
                       programs_total=programs.get("total"), programs_compiled=programs.get("compiled"),
                       programs_loaded=programs.get("loaded"), build_seconds=programs.get("seconds"),
                       warmup_status=status, by_kind=programs.get("by_kind"), programs_source=programs.get("source"),
                       zipage_jax=r.get("zipage_jax"))
            self._error_fields(run, r)
            _say(f"warmup      {tree.name:8s} {label:5s}: warmed at {_fmt(run['ready_at_s'])} s "
                 f"(grid {run['grid_programs']}; {_programs_line(run)}; build {_fmt(run['build_seconds'])} s)")
            return run

        return {"options": {**self.options, "warmup": True}, **self.interleaved("warmup", measure)}

    @staticmethod
    def _error_fields(run: dict, r: dict) -> None:
        if not run["ok"]:
            run.update(error=r.get("error") or "no first token", log_tail=r.get("log_tail"),
                       traceback=r.get("traceback"))

    def server(self) -> dict:
        args = self.args
        common = server_flags({**SERVER_DEFAULTS, **self.options})
        modes = {"current": {"flags": common, "warmup": "the server's default: a background warm-up where this "
                             "checkout's server has one (/health 200 once the serving set is ready; grid_done_s "
                             "when /metrics says the whole grid is built); without one grid_done_s is null"}}
        if "baseline" in self.trees:
            modes["baseline"] = {"flags": common + ["--warmup"], "warmup": "--warmup, as its users ran it: "
                                 "/health 200 only once the whole grid is compiled, so grid_done_s = health_s"}
            if "baseline_no_warmup" not in args.skip:
                modes["baseline_no_warmup"] = {"flags": common + ["--no-warmup"], "warmup": "none: programs "
                                               "compile when the first steps need them (cold start only)"}

        def measure_as(mode: str):
            def measure(tree: Tree, cache: Path, label: str) -> dict:
                run = self.run_server(tree, cache, f"{mode}-{label}", modes[mode]["flags"],
                                      grid_from_health=mode == "baseline")
                _say(f"server      {mode:8s} {label:5s}: /health 200 at {_fmt(run.get('health_s'))} s, TTFT p50 "
                     f"{_fmt(run.get('ttft_p50_s'), 2)} s p90 {_fmt(run.get('ttft_p90_s'), 2)} s "
                     f"({run.get('succeeded')}/{run.get('streams')} ok), grid built at "
                     f"{_fmt(run.get('grid_done_s'))} s ({run.get('grid_done_from')})")
                return run
            return measure

        caches, out = {}, {}
        for tree in self.trees.values():
            caches[tree.name] = self.fresh_cache(tree, "server")
            out[tree.name] = {"cold": measure_as(tree.name)(tree, caches[tree.name], "cold"), "warm": {"runs": []}}
            if tree.name == "baseline" and "baseline_no_warmup" in modes:
                cache = self.fresh_cache(tree, "server-no-warmup")
                out["baseline_no_warmup"] = {"cold": measure_as("baseline_no_warmup")(tree, cache, "cold")}
        for i in range(args.runs):
            for tree in self.trees.values():
                out[tree.name]["warm"]["runs"].append(measure_as(tree.name)(tree, caches[tree.name], f"warm{i + 1}"))
        for tree in self.trees.values():
            out[tree.name]["warm"]["median"] = median_fields(out[tree.name]["warm"]["runs"])
        return {"streams": args.streams, "max_tokens": args.stream_tokens, "host": "127.0.0.1", "modes": modes,
                **out}

    def run_server(self, tree: Tree, cache: Path, label: str, flags: list[str], grid_from_health: bool) -> dict:
        base = self._name("server", tree.name, label)
        base.parent.mkdir(parents=True, exist_ok=True)
        log = base.with_suffix(".log")
        port = _free_port()
        cmd = [sys.executable, str(tree.root / "scripts" / "serve_jax.py"), "--model", self.args.model,
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
               *flags]
        run: dict = {"ok": False, "flags": flags}
        with log.open("w") as log_file:
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=tree.root, env=self._env(tree, cache), stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                run.update(asyncio.run(self._server_session(proc, f"http://127.0.0.1:{port}", t0)))
            except Exception as exc:  # noqa: BLE001 - reported in the run
                run["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                run["exit"] = stop_process(proc)
        if grid_from_health and run.get("health_s") is not None:
            run["grid_done_s"], run["grid_done_from"] = run["health_s"], "health (--warmup)"
        if not run.get("ok"):
            run["log_tail"] = _tail(log)
            self.errors.append(f"server {tree.name} {label}: {run.get('error')}")
            _say(f"  server {tree.name} {label} FAILED: {run.get('error')} (log: {log})")
        return run

    async def _server_session(self, proc: subprocess.Popen, url: str, t0: float) -> dict:
        import httpx

        args = self.args
        deadline = time.monotonic() + args.timeout
        limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits) as client:
            health_s = None
            while health_s is None:
                if proc.poll() is not None:
                    return {"error": f"the server exited with status {proc.returncode} before /health 200"}
                if time.monotonic() > deadline:
                    return {"error": f"no /health 200 within {args.timeout} s"}
                try:
                    if (await client.get(f"{url}/health", timeout=5.0)).status_code == 200:
                        health_s = time.time() - t0
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            poller = asyncio.create_task(self._poll_grid(client, url, t0, deadline))
            streams = await asyncio.gather(*(self._bounded_stream(client, url, i, deadline)
                                             for i in range(args.streams)))
            streams_done_s = time.time() - t0
            grid = await poller
        summary = stream_summary(streams)
        return {"ok": True, "health_s": health_s, **summary, "streams_done_at_s": streams_done_s, **grid}

    async def _poll_grid(self, client, url: str, t0: float, deadline: float, give_up_s: float = 5.0) -> dict:
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
                "grid_note": f"the grid was not built within {self.args.timeout} s of the start"}

    async def _bounded_stream(self, client, url: str, i: int, deadline: float) -> dict:
        """One stream, given up at the deadline (httpx's timeouts bound each read, not the whole stream)."""
        try:
            return await asyncio.wait_for(self._stream(client, url, i), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return {"ok": False, "ttft_s": None, "seconds": None, "chunks": None,
                    "error": f"not finished within {self.args.timeout:g} s of the start"}

    async def _stream(self, client, url: str, i: int) -> dict:
        import httpx

        body = {"model": "bench", "prompt": f"Request {i}: name one fact about the number {i + 7}.",
                "max_tokens": self.args.stream_tokens, "temperature": 0, "stream": True}
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

    def qwen3_8b(self) -> dict:
        quick = self.args.quick
        shape = QWEN3_QUICK if quick else QWEN3_8B
        options = QWEN3_QUICK_OPTIONS if quick else QWEN3_OPTIONS
        dtype = self.args.qwen3_dtype
        out = {"model_config": shape, "engine_options": {**options, "dtype": dtype, "compilation_cache_dir": ""},
               "platform": "cpu (JAX_PLATFORMS=cpu)", "scaled_down": quick,
               "weights": "none: Decoder(rngs=None), every parameter a jax.ShapeDtypeStruct",
               "subset": "decode rows smallest and largest, prefill rows largest, the largest compression and "
                         "history buckets, built in grid order through the grid's build callables",
               "extrapolation": "per kind: mean build seconds (trace + lower + compile, timed around each "
                                "program's build) of the measured programs x the programs of that kind in the "
                                "grid; the prefill, compression and history programs measured are their kinds' "
                                "largest, so those estimates are upper bounds; serial seconds (a warm-up builds "
                                "programs on parallel threads)"}
        for tree in self.trees.values():
            cache = self.workdir / tree.name / "qwen3" / "cache"
            cache.mkdir(parents=True)
            r = self.worker("qwen3_8b", tree, cache, "cold", cpu=True, model_config=shape, dtype=dtype,
                            options=options)
            if r.get("ok"):
                before, after = r["params_before"], r["params_after"]
                would_be = before["abstract_gb"]
                r["memory"] = {"peak_rss_gb": r["peak_rss_gb"], "weights_would_be_gb": would_be,
                               "params_abstract": before["abstract_leaves"], "params_real_mb": after["real_mb"],
                               "weights_stayed_abstract": after["abstract_leaves"] == before["abstract_leaves"]
                               and before["abstract_leaves"] > 0,
                               "peak_rss_below_weights": None if would_be < 1 else r["peak_rss_gb"] < would_be}
                total = r["extrapolated"]["estimated_grid_s"]
                _say(f"qwen3_8b    {tree.name:8s}: grid {r['grid']['size']} programs, built "
                     f"{len(r['programs'])} in {_fmt(sum(p['build_s'] for p in r['programs']))} s, whole grid "
                     f"~{_fmt(total)} s serial; peak RSS {_fmt(r['peak_rss_gb'], 2)} GB (weights would be "
                     f"{_fmt(would_be, 1)} GB)")
            out[tree.name] = r
        return out

    def run(self) -> dict:
        args = self.args
        results: dict = {}
        engine_sections = [s for s in ("first_token", "warmup", "server") if s not in args.skip]
        if engine_sections:
            self.convert()
        for section in ("first_token", "warmup", "server", "qwen3_8b"):
            if section in args.skip:
                continue
            _say(f"== {section}")
            results[section] = getattr(self, section)()
        return results


SNAPSHOT_DIRS = ("zipage_jax", "pallas_kernels", "scripts")


def snapshot_tree(path: Path, commit: str) -> Tree:
    """This tree's code as it is now (untracked files included), copied to `path`: every run
    measures the same code, however the working tree changes meanwhile (the executable store's
    key hashes the engine's source: an edit between a cold and a warm run would make it cold)."""
    for name in SNAPSHOT_DIRS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, path / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return Tree("current", path, commit)


def add_worktree(commit: str, path: Path) -> Tree:
    resolved = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    if resolved.returncode:
        raise SystemExit(f"--baseline {commit}: not a commit of {ROOT}: {resolved.stderr.strip()}")
    full = resolved.stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", str(path), full], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    return Tree("baseline", path, full)


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True, timeout=300)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True, timeout=60)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="the model of every engine and server (default: default)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="COMMIT",
                        help=f"the commit to compare with (default: {DEFAULT_BASELINE}); none: this tree only")
    parser.add_argument("--runs", type=int, default=None, help="warm runs of each measurement (default: 3; --quick 1)")
    parser.add_argument("--skip", action="append", default=[], metavar="SECTIONS",
                        help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    parser.add_argument("--option", action="append", type=parse_option, default=[], metavar="NAME=VALUE",
                        help="an engine option for every engine and server (repeat; e.g. max_num_seqs=8)")
    parser.add_argument("--streams", type=int, default=None,
                        help=f"concurrent streams sent to a new server (default: {STREAMS}; --quick {QUICK_STREAMS})")
    parser.add_argument("--stream-tokens", type=int, default=None,
                        help=f"max_tokens of each stream (default: {STREAM_TOKENS}; --quick {QUICK_STREAM_TOKENS})")
    parser.add_argument("--qwen3-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds any one process or server may take (default: 1800; --quick 300)")
    parser.add_argument("--quick", action="store_true",
                        help="the tests' settings: one warm run, a small engine config, 8 streams of 4 tokens, a "
                             "scaled-down Qwen3 shape (pass a tiny model with --model)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (caches and logs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.skip = {s.strip() for item in args.skip for s in item.split(",") if s.strip()}
    unknown = args.skip - set(SECTIONS)
    if unknown:
        parser.error(f"--skip: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    quick = args.quick
    args.runs = args.runs if args.runs is not None else (1 if quick else 3)
    args.streams = args.streams or (QUICK_STREAMS if quick else STREAMS)
    args.stream_tokens = args.stream_tokens or (QUICK_STREAM_TOKENS if quick else STREAM_TOKENS)
    args.timeout = args.timeout or (300.0 if quick else 1800.0)
    if args.runs < 1 or args.streams < 1 or args.stream_tokens < 1:
        parser.error("--runs, --streams and --stream-tokens must be >= 1")
    args.engine_options = {**(QUICK_OPTIONS if quick else {}), **dict(args.option)}
    if args.baseline.lower() == "none":
        args.baseline = None
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1])
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench_startup-"))
    from zipage_jax.run_info import git_commit, run_info

    trees = {"current": snapshot_tree(workdir / "current-tree", git_commit())}
    baseline_path = workdir / "baseline-tree"
    summary: dict = {"model": args.model, "quick": args.quick, "runs": args.runs, "engine_options": args.engine_options,
                     "skipped": sorted(args.skip)}
    try:
        if args.baseline is not None:
            trees["baseline"] = add_worktree(args.baseline, baseline_path)
        summary["trees"] = {name: {"commit": t.commit} for name, t in trees.items()}
        summary["trees"]["current"]["source"] = f"a copy of {', '.join(SNAPSHOT_DIRS)} of {ROOT} taken at the start"
        if args.baseline is not None:
            summary["trees"]["baseline"]["requested"] = args.baseline
        _say(f"bench_startup: model {args.model}, trees {', '.join(f'{n} {t.commit}' for n, t in trees.items())}, "
             f"{args.runs} warm run(s), work in {workdir}")
        bench = Bench(args, workdir, trees)
        summary.update(bench.run())
        summary["conversion"] = bench.conversion or None
        summary["goals"] = evaluate_goals(summary, trees)
        summary["errors"] = bench.errors
    finally:
        if args.baseline is not None and baseline_path.exists():
            remove_worktree(baseline_path)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    verdicts = {True: "met", False: "not met", None: "not measured"}
    for name, goal in summary["goals"].items():
        _say(f"goal {name} <= {goal['goal']:g} s: " + ", ".join(
            f"{tree} {_fmt(goal[tree]['value'])} s ({verdicts[goal[tree]['met']]})"
            for tree in ("current", "baseline") if goal[tree] is not None))
    summary["run"] = run_info()
    print(json.dumps(summary, default=str) if args.json else json.dumps(summary, indent=2, default=str))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
