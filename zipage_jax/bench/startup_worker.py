"""One measuring process of `zipage-jax bench startup`: converts the model, streams a first
token, warms an engine up, or builds a Qwen3-8B-shaped grid without weights, and writes what it
measured (time.time() stamps) to the spec's "out" file.

    python -P zipage_jax/bench/startup_worker.py SPEC.json

It measures the tree first on PYTHONPATH (this tree's copy, or a baseline commit's worktree,
which may predate this file), so it is run by its path, not as a module of the package, and
imports only the standard library at the top: zipage_jax comes from the measured tree.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

KINDS = ("forward_decode", "forward_prefill", "compression", "history")


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


def main(spec_path: str) -> int:
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


def _runner(engine):
    """The engine's model runner: under its engine core, or on the engine itself in a tree from before the
    engine core (the default baseline)."""
    return getattr(engine, "core", engine).runner


def _work_first_token(spec: dict) -> dict:
    stamps = {}
    from zipage_jax import LLM, SamplingParams

    stamps["imported"] = time.time()
    llm = LLM(spec["model"], **spec["options"])
    stamps["engine_ready"] = time.time()
    runner = _runner(llm.engine)
    at_first, texts, tokens = None, [], 0
    for out in llm.stream(spec["prompt"], SamplingParams(temperature=0, max_tokens=spec["max_tokens"])):
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
    return {"stamps": stamps, "warmup_status": status, "grid_programs": len(_runner(engine).step_grid()),
            "programs": program_summary(_runner(engine)), "zipage_jax": _package_file()}


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
    from zipage_jax.models.config import ModelConfig
    from zipage_jax.models.decoder import Decoder
    from zipage_jax.models.loading import LoadedModel

    try:
        from zipage_jax.engine.runner.model_runner import ModelRunner
    except ModuleNotFoundError:  # a tree from before engine/runner/ became a package (the default baseline)
        from zipage_jax.engine.runner import ModelRunner

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
