"""One command for a GPU run (H200, jax 0.11.2 with the cuda13 plugin, no network), under 9 minutes.

    zipage-jax bench gpu [--budget-s 480] [--skip SECTION ...] [size flags, see --help]
    zipage-jax bench gpu --smoke    # tiny shapes, Pallas interpreter and XLA: the benchmark's logic on a CPU

(`python scripts/bench_gpu.py ...` is the same, from a checkout with the package installed.)

Sections, in this order; each prints one JSON line {"section": ..., "ok": ..., ...} as it ends,
or {"section": ..., "ok": false, "error": ...} if it failed or ran past its time, and the next runs:
  environment       jax version, backend, device kind, the peak bandwidth used
  paged_decode      the decode kernel vs its reference: Qwen3-8B / Llama-3-8B (32/8 heads, head dim
                    128) and SmolLM2-135M (9/3, 64) heads, block sizes 16 and 256, bf16 and f32,
                    ragged lengths with a padding row
  decode_bandwidth  the decode kernel at batch 64 and 4k context (bf16): time per call, K/V bytes
                    read per second and the fraction of the peak (4.8 TB/s on an H200); XLA's time
  attention_score   the cached-query score kernel vs its reference, same shapes as paged_decode
  compact           the compaction kernel vs its reference, bit for bit: every adversarial keep
                    pattern of zipage_jax/bench/compact_cases.py and --seeds random ones, block sizes 16 and
                    256, bf16 / f32 / int8 / fp8 K/V with float32 per-token scales
  compaction_time   per layer, pools donated (so in place): the compaction kernel alone and the whole
                    compression step (score, select, compact), Pallas vs XLA, at Qwen3-8B shapes
  engine_default    full KV vs compression at equal pool memory (the same num_kvcache_blocks),
                    --engine-requests long greedy generations, the default model (`bench throughput`)
  engine_qwen3_8b   the same on a random-initialised Qwen3-8B-shaped model in bfloat16 (speed does
                    not depend on the weights), with a byte tokenizer
The last line is one JSON object with every section under "sections", "ok" and "seconds".

Time: every section runs under what is left of --budget-s (default 480 s) and at most its share
(SECTION_SECONDS; the engine sections get the rest). Timing estimates for an H200 (none
measured yet): the kernel sections about 2-3 minutes together (mostly Triton and XLA
compiles), each engine section 1.5-3 minutes (compiles of the bucketed step shapes, then
64 x 1024 tokens). Sizes are flags: lower --engine-max-tokens, --engine-requests or --seeds to
shorten a run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import time
import traceback
import warnings

from zipage_jax.bench.compact_cases import PATTERNS, compaction_case, num_pool_blocks
from zipage_jax.bench.throughput import run_benchmark
from zipage_jax.bench.workload import Workload
from zipage_jax.harness import log, median_seconds, run_record
from zipage_jax.models.random_model import QWEN3_8B, TINY_QWEN3, random_model

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

PEAK_BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "H20": 4000.0, "A100": 2039.0, "L40S": 864.0}

# (q heads, kv heads, head dim); Llama-3-8B has the same attention shapes as Qwen3-8B
MODELS = {"qwen3-8b/llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
SMOKE_MODELS = {"tiny": (4, 2, 16)}

# the most seconds a section may take (a share of the budget; the engine sections get the rest)
SECTION_SECONDS = {"paged_decode": 60, "decode_bandwidth": 40, "attention_score": 60, "compact": 60,
                   "compaction_time": 60, "engine_default": 180}

class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises SectionTimeout in the main thread after `seconds` (between Python bytecodes)."""
    if seconds <= 0:
        raise SectionTimeout("no time left in the budget")

    def fire(signum, frame):
        raise SectionTimeout(f"section ran past its {seconds:.0f}s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def time_call(fn, *args, iters: int) -> float:
    """Median seconds per call after two warm-up calls (which compile)."""
    import jax

    def call():
        return jax.block_until_ready(fn(*args))

    for _ in range(2):
        call()
    return median_seconds(call, runs=iters)


def time_threaded(step, state, *, iters: int) -> tuple[float, object]:
    """Median seconds of `state = step(state)` (state donated), after two warm-up calls."""
    import jax

    for _ in range(2):
        state = jax.block_until_ready(step(state))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - start)
    return statistics.median(times), state


def max_abs_err(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def kernel_grid(args):
    """(model, (q heads, kv heads, head dim), block size, dtype name) of the kernel checks."""
    models = SMOKE_MODELS if args.smoke else MODELS
    sizes, dtypes = ((16,), ("float32",)) if args.smoke else ((16, 256), ("bfloat16", "float32"))
    return [(m, heads, bs, dt) for m, heads in models.items() for bs in sizes for dt in dtypes]


def peak_bandwidth(args) -> float | None:
    if args.peak_gbs:
        return args.peak_gbs
    import jax

    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in kind), None)


# -- kernels ------------------------------------------------------------------------------------


def section_environment(args) -> dict:
    import jax

    return {"ok": True, "jax": jax.__version__, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
            "peak_gbs": peak_bandwidth(args), "smoke": args.smoke}


def decode_inputs(seed, batch, heads, block_size, context, dtype):
    """Random q [B, Hq, D], K/V pools [B * W + 1, P, Hkv, D] and block tables [B, W] (a
    permutation of the pages, the dummy page 0 unused) for `context` keys per row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    q_heads, kv_heads, head_dim = heads
    width = -(-context // block_size)
    shape = (batch * width + 1, block_size, kv_heads, head_dim)
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    k_pool, v_pool = jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (batch, q_heads, head_dim), dtype)
    tables = 1 + np.random.default_rng(seed).permutation(batch * width).reshape(batch, width)
    return q, k_pool, v_pool, jnp.asarray(tables, jnp.int32)


def section_paged_decode(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_decode_attention
    from zipage_jax.layers.xla_paged_attention import paged_decode_attention_reference

    batch, context = (3, 40) if args.smoke else (8, 1024)
    kernel = jax.jit(functools.partial(paged_decode_attention, interpret=args.smoke))
    rows = []
    for model, heads, block_size, dtype in kernel_grid(args):
        q, k_pool, v_pool, tables = decode_inputs(0, batch, heads, block_size, context, jnp.dtype(dtype))
        lens = np.random.default_rng(1).integers(1, context + 1, batch).astype(np.int32)
        lens[0], lens[-1] = context, 0  # a full row and a padding row
        lens = jnp.asarray(lens)
        with jax.default_matmul_precision("highest"):
            ref = paged_decode_attention_reference(q, k_pool, v_pool, tables, lens)
        err = max_abs_err(kernel(q, k_pool, v_pool, tables, lens), ref)
        tol = 1e-2 if dtype == "float32" else 5e-2  # f32 dots in Triton default to TF32
        rows.append({"model": model, "block_size": block_size, "dtype": dtype, "max_abs_err": err, "ok": err <= tol})
    return {"ok": all(r["ok"] for r in rows), "batch": batch, "context": context, "cases": rows}


def section_decode_bandwidth(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_decode_attention
    from zipage_jax.layers.xla_paged_attention import paged_decode_attention_reference

    peak = peak_bandwidth(args)
    batch, context = args.decode_batch, args.decode_context
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    kernel = jax.jit(functools.partial(paged_decode_attention, interpret=args.smoke))
    rows = []
    for model, heads, block_size, name in kernel_grid(args):
        if name != jnp.dtype(dtype).name:
            continue
        q, k_pool, v_pool, tables = decode_inputs(2, batch, heads, block_size, context, dtype)
        lens = jnp.full((batch,), context, jnp.int32)
        seconds = time_call(kernel, q, k_pool, v_pool, tables, lens, iters=args.iters)
        xla_seconds = time_call(paged_decode_attention_reference, q, k_pool, v_pool, tables, lens, iters=args.iters)
        kv_bytes = 2 * batch * context * heads[1] * heads[2] * jnp.dtype(dtype).itemsize
        gbs = kv_bytes / seconds / 1e9
        rows.append({"model": model, "block_size": block_size, "kernel_ms": 1e3 * seconds,
                     "xla_ms": 1e3 * xla_seconds, "kv_gbytes": kv_bytes / 1e9, "achieved_gbs": gbs,
                     "fraction_of_peak": None if peak is None else gbs / peak})
    return {"ok": True, "batch": batch, "context": context, "dtype": jnp.dtype(dtype).name, "peak_gbs": peak,
            "cases": rows}


def section_attention_score(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention_score import attention_score, attention_score_reference

    batch, query_len = (3, 4) if args.smoke else (8, 16)
    kernel = jax.jit(functools.partial(attention_score, interpret=args.smoke))
    rows = []
    for model, heads, block_size, dtype in kernel_grid(args):
        q_heads, kv_heads, head_dim = heads
        width = 4 if block_size == 256 else 32  # 1k / 512 tokens
        _, k_pool, _, tables = decode_inputs(3, batch, heads, block_size, width * block_size, jnp.dtype(dtype))
        queries = jax.random.normal(jax.random.key(4), (batch, query_len, q_heads, head_dim), dtype)
        num_blocks = np.random.default_rng(5).integers(1, width + 1, batch).astype(np.int32)
        num_blocks[-1] = 0  # a padding row
        inputs = (k_pool, queries, tables, jnp.asarray(num_blocks))
        err = max_abs_err(kernel(*inputs), attention_score_reference(*inputs))
        rows.append({"model": model, "block_size": block_size, "dtype": dtype, "max_abs_err": err,
                     "ok": err <= 1e-5, "kernel_ms": 1e3 * time_call(kernel, *inputs, iters=args.iters),
                     "xla_ms": 1e3 * time_call(attention_score_reference, *inputs, iters=args.iters)})
    return {"ok": all(r["ok"] for r in rows), "batch": batch, "query_len": query_len, "cases": rows}


def _random_bits(key, shape, dtype):
    """Random bit patterns (NaN and inf included), so every slot differs: compared bit for bit."""
    import jax
    import jax.numpy as jnp

    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, width), dtype)


def section_compact(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.compact import compact, compact_reference

    _, kv_heads, head_dim = next(iter((SMOKE_MODELS if args.smoke else MODELS).values()))
    num_seqs, budget, width = (3, 2, 4) if args.smoke else (8, 3, 6)
    kernel = jax.jit(functools.partial(compact, interpret=args.smoke))
    sizes = (16,) if args.smoke else (16, 256)
    dtypes = ("int8",) if args.smoke else ("bfloat16", "float32", "int8", "float8_e4m3fn")
    cases = [(p, 0) for p in PATTERNS] + [("random", s) for s in range(1, args.seeds + 1)]
    rows = []
    for block_size in sizes:
        shape = (num_pool_blocks(num_seqs, width, budget), block_size, kv_heads)
        for dtype in dtypes:
            keys = jax.random.split(jax.random.key(block_size), 3)
            pools = [_random_bits(keys[0], shape + (head_dim,), dtype),
                     _random_bits(keys[1], shape + (head_dim,), dtype),
                     _random_bits(keys[2], shape, jnp.float32)]  # per-token scales / score cache
            failed = []
            for pattern, seed in cases:
                tables, targets, keep = compaction_case(pattern, seed, num_seqs=num_seqs, num_kv_heads=kv_heads,
                                                        width=width, budget=budget, block_size=block_size)
                inputs = (jnp.asarray(keep), jnp.asarray(tables), jnp.asarray(targets))
                ours, ref = kernel(pools, *inputs), compact_reference(pools, *inputs)
                if any(np.asarray(a).tobytes() != np.asarray(b).tobytes() for a, b in zip(ours, ref, strict=True)):
                    failed.append(f"{pattern}/{seed}")
            rows.append({"block_size": block_size, "dtype": dtype, "cases": len(cases), "failed": failed,
                         "ok": not failed})
    return {"ok": all(r["ok"] for r in rows), "kv_heads": kv_heads, "head_dim": head_dim, "num_seqs": num_seqs,
            "budget_blocks": budget, "width": width, "configs": rows}


def _compaction_time_case(args, block_size: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.compact import compact, compact_reference
    from pallas_kernels.kv_pool import KVPool
    from zipage_jax.backend import Backend
    from zipage_jax.compress.policies import POLICIES, compress_rows, resolve_budget
    from zipage_jax.compress.step import compress
    from zipage_jax.config import EngineConfig

    q_heads, kv_heads, head_dim = next(iter((SMOKE_MODELS if args.smoke else MODELS).values()))
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    batch, layers = (2, 2) if args.smoke else (8, 4)  # batch: the engine's max_compress_seqs
    m = max(1, 512 // block_size)  # a 512-token budget
    blocks = m + 2
    width = 1 << (blocks - 1).bit_length()  # the runner's bucket
    # a realistic pool (512k tokens; 1 GB per layer's K at Qwen3-8B shapes): a copy would show
    num_pool_blocks = batch * blocks + 1 if args.smoke else (1 << 19) // block_size + 1
    rng = np.random.default_rng(6)
    tables = np.zeros((batch, width), np.int32)
    tables[:, :blocks] = 1 + rng.permutation(num_pool_blocks - 1)[: batch * blocks].reshape(batch, blocks)
    tables = jnp.asarray(tables)
    shape = (num_pool_blocks, block_size, kv_heads, head_dim)
    keys = iter(jax.random.split(jax.random.key(7), 4 * layers))
    k = [jax.random.normal(next(keys), shape, dtype) for _ in range(layers)]
    v = [jax.random.normal(next(keys), shape, dtype) for _ in range(layers)]
    s = [jax.random.uniform(next(keys), shape[:3], jnp.float32, 0, 0.01) for _ in range(layers)]
    q = [jax.random.normal(next(keys), (batch, 16, q_heads, head_dim), dtype) for _ in range(layers)]
    keep = np.zeros((batch, kv_heads, width * block_size), bool)
    for b in range(batch):
        for h in range(kv_heads):
            keep[b, h, np.sort(rng.choice(blocks * block_size, m * block_size, replace=False))] = True
    keep = jnp.asarray(keep.reshape(batch, kv_heads, width, block_size))
    targets = tables[:, :m]  # in place
    row = {"block_size": block_size, "budget_blocks": m, "batch": batch, "layers": layers,
           "pool_gbytes": 2 * k[0].nbytes / 1e9,
           "moved_gbytes": 2 * batch * kv_heads * m * block_size * head_dim * jnp.dtype(dtype).itemsize / 1e9}
    backends = {"pallas": functools.partial(compact, interpret=args.smoke), "xla": compact_reference}
    for name, fn in backends.items():
        step = jax.jit(lambda pools, *a, fn=fn: fn(pools, *a), donate_argnums=0)
        seconds, _ = time_threaded(lambda pools, step=step: step(pools, keep, tables, targets),
                                   [k[0].copy(), v[0].copy(), s[0].copy()], iters=args.iters)
        row[f"compact_{name}_ms_per_layer"] = 1e3 * seconds
    engine = EngineConfig(kvcache_block_size=block_size, query_cache_len=16)
    cfg, policy = engine.compression, POLICIES[engine.eviction_policy]
    budget = resolve_budget(policy, policy.options(), m, block_size, engine.query_cache_len)
    rows = compress_rows([budget] * batch)
    batch_args = (tables, jnp.full((batch,), blocks, jnp.int32), jnp.arange(batch, dtype=jnp.int32),
                  jnp.asarray(rng.random(batch) < 0.5), tables, rows)  # in place: targets = the tables
    for backend in (Backend.PALLAS_INTERPRET if args.smoke else Backend.PALLAS, Backend.XLA):
        step = jax.jit(functools.partial(compress, cfg=cfg, backend=backend), donate_argnames=("layers",))
        layer_pools = [KVPool(k[i].copy(), v[i].copy(), scores=s[i].copy()) for i in range(layers)]
        seconds, _ = time_threaded(lambda pools, step=step: step(pools, q, *batch_args), layer_pools, iters=args.iters)
        name = "xla" if backend is Backend.XLA else "pallas"
        row[f"compress_step_{name}_ms_per_layer"] = 1e3 * seconds / layers
    return row


def section_compaction_time(args) -> dict:
    rows = [_compaction_time_case(args, bs) for bs in ((16,) if args.smoke else (256, 16))]
    return {"ok": True, "policy": "the engine's default scoring", "cases": rows}


# -- engine -------------------------------------------------------------------------------------


def _engine_run(args, model: str, loaded=None) -> dict:
    prompt_len = args.engine_prompt_len
    workload = Workload(requests=args.engine_requests, prompt_len_min=prompt_len, prompt_len_max=prompt_len,
                        max_tokens=args.engine_max_tokens, block_size=args.engine_block_size,
                        budget_blocks=args.engine_budget_blocks)
    options = {"dtype": "float32" if args.smoke else "bfloat16",
               "attention_backend": "xla" if args.smoke else "pallas"}
    # no warm-up of the whole step grid (dozens of programs, past the section's time): the
    # shapes the run meets compile on first use, and the engine's compile time is left out
    summary = run_benchmark(workload, model, options, loaded=loaded, warmup=False, log=log)
    summary["ok"] = summary["speedup"] > 0 and summary["zipage"]["compressions"] > 0
    return summary


def section_engine_default(args) -> dict:
    return _engine_run(args, args.model)


def section_engine_qwen3_8b(args) -> dict:
    shape = TINY_QWEN3 if args.smoke else QWEN3_8B
    loaded = random_model(shape, "float32" if args.smoke else "bfloat16", args.qwen_layers)
    summary = _engine_run(args, "random-qwen3-8b", loaded)
    summary["model_config"] = {k: v for k, v in shape.items() if k != "rope_scaling"} | {
        "num_layers": loaded.config.num_layers}
    return summary


SECTIONS = {
    "environment": section_environment,
    "paged_decode": section_paged_decode,
    "decode_bandwidth": section_decode_bandwidth,
    "attention_score": section_attention_score,
    "compact": section_compact,
    "compaction_time": section_compaction_time,
    "engine_default": section_engine_default,
    "engine_qwen3_8b": section_engine_qwen3_8b,
}

# the size flags' values on the GPU and with --smoke, unless given
SIZES = {
    "gpu": dict(iters=20, decode_batch=64, decode_context=4096, seeds=16, engine_requests=64,
                engine_prompt_len=256, engine_max_tokens=1024, engine_block_size=256, engine_budget_blocks=2),
    "smoke": dict(iters=1, decode_batch=2, decode_context=64, seeds=2, engine_requests=3, engine_prompt_len=16,
                  engine_max_tokens=40, engine_block_size=16, engine_budget_blocks=1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpreter and XLA, on the CPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all sections")
    parser.add_argument("--skip", nargs="+", default=[], choices=list(SECTIONS), metavar="SECTION")
    parser.add_argument("--peak-gbs", type=float, help="device memory bandwidth, GB/s (default: from the device kind)")
    parser.add_argument("--model", default="default", help="the engine_default section's model")
    parser.add_argument("--qwen-layers", type=int, help="layers of the random Qwen3-8B-shaped model (default 36)")
    helps = {"iters": "timed calls per measurement", "seeds": "random keep patterns per compaction config",
             "engine_max_tokens": "tokens generated per request", "engine_budget_blocks": "compression budget M"}
    for name, value in SIZES["gpu"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            help=f"{helps.get(name, '')} (GPU: {value}, smoke: {SIZES['smoke'][name]})".lstrip())


def fill_sizes(args: argparse.Namespace) -> None:
    """Every size flag not given takes its value on the GPU, or with --smoke."""
    for name, value in SIZES["smoke" if args.smoke else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    fill_sizes(args)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.monotonic()
    report: dict = {"sections": {}}
    for name, fn in SECTIONS.items():
        if name in args.skip:
            continue
        left = args.budget_s - (time.monotonic() - start)
        t = time.monotonic()
        try:
            with deadline(left if args.smoke else min(left, SECTION_SECONDS.get(name, left))):
                result = fn(args)
        except Exception as exc:  # noqa: BLE001 - every failure (a SectionTimeout too) is reported, the run goes on
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)[-3000:]}
        result["seconds"] = time.monotonic() - t
        report["sections"][name] = result
        print(json.dumps({"section": name, **result}), flush=True)
    report["ok"] = all(r.get("ok", False) for r in report["sections"].values())
    report["seconds"] = time.monotonic() - start
    report["run"] = run_record()
    print(json.dumps(report), flush=True)  # always one line: the last of the sections' JSON lines
    return 0 if report["ok"] else 1
