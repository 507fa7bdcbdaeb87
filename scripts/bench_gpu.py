"""One self-contained GPU run (H200, jax 0.11.2, no network): kernels, bandwidth, compaction, throughput.

    python scripts/bench_gpu.py [--budget-s 480] [--model default] [--peak-gbs 4800] [--skip-throughput]
    python scripts/bench_gpu.py --cpu-smoke    # tiny shapes, Pallas interpreter: tests the script on a CPU

Sections, each guarded (an error or a timeout is reported in its JSON, the next one runs):
  environment      jax version, backend, device kind
  paged_decode     `paged_decode_attention` vs its XLA reference at realistic shapes; time per
                   call and achieved bandwidth (K/V bytes read / time) against the device peak
  attention_score  the cached-query score kernel vs its jnp reference; time per call
  compact          the in-page compaction kernel vs its reference (bit-identical); time per call
  compress_step    one whole compaction (score, select, compact) of a batch of sequences, per
                   layer, Pallas and XLA backends
  throughput       bench_throughput's default preset (32 long generations) on the default model

Each section prints one JSON line as it finishes; the last line is one JSON object with all
of them under "sections", plus "ok" (every section passed) and "seconds".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

PEAK_BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "H20": 4000.0, "A100": 2039.0, "L40S": 864.0}

# (batch, q heads, kv heads, head dim, block size, context) for the bandwidth figure
DECODE_SHAPES = {
    "gpu": [(64, 32, 8, 128, 32, 4096), (16, 32, 8, 128, 16, 16384), (128, 9, 3, 64, 16, 2048)],
    "smoke": [(2, 4, 2, 16, 16, 40)],
}
# (batch, QL, q heads, kv heads, head dim, block size, width, M)
SCORE_SHAPES = {"gpu": (8, 16, 32, 8, 128, 256, 16, 8), "smoke": (2, 4, 4, 2, 16, 16, 4, 2)}
# (layers, batch, QL, q heads, kv heads, head dim, block size, M)
COMPRESS_SHAPES = {"gpu": (4, 8, 16, 32, 8, 128, 256, 8), "smoke": (2, 2, 4, 4, 2, 16, 16, 2)}


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


def time_call(fn, *args, iters: int = 10) -> float:
    """Median seconds per call after two warm-up calls (which compile)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def max_abs_err(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# -- sections ----------------------------------------------------------------------------------


def section_environment(args) -> dict:
    import jax

    device = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "num_devices": jax.device_count(), "peak_gbs": peak_bandwidth(args)}


def peak_bandwidth(args) -> float | None:
    if args.peak_gbs:
        return args.peak_gbs
    import jax

    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in kind), None)


def section_paged_decode(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference

    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    peak = peak_bandwidth(args)
    rows = []
    for batch, q_heads, kv_heads, head_dim, block_size, context in DECODE_SHAPES[args.size]:
        rng = np.random.default_rng(0)
        width = -(-context // block_size)
        num_blocks = batch * width + 1
        key = jax.random.key(0)
        kk, kv, kq = jax.random.split(key, 3)
        k_pool = jax.random.normal(kk, (num_blocks, block_size, kv_heads, head_dim), dtype)
        v_pool = jax.random.normal(kv, (num_blocks, block_size, kv_heads, head_dim), dtype)
        q = jax.random.normal(kq, (batch, q_heads, head_dim), dtype)
        tables = jnp.asarray(1 + rng.permutation(batch * width).reshape(batch, width), jnp.int32)
        # correctness on ragged lengths (one padding row), bandwidth on full ones
        ragged = rng.integers(1, context + 1, batch).astype(np.int32)
        ragged[-1] = 0
        ragged = jnp.asarray(ragged)
        full = jnp.full((batch,), context, jnp.int32)
        kernel = jax.jit(lambda *a: paged_decode_attention(*a, interpret=args.cpu_smoke))
        with jax.default_matmul_precision("highest"):
            ref = paged_decode_attention_reference(q, k_pool, v_pool, tables, ragged)
        err = max_abs_err(kernel(q, k_pool, v_pool, tables, ragged), ref)
        seconds = time_call(kernel, q, k_pool, v_pool, tables, full, iters=args.iters)
        xla_seconds = time_call(paged_decode_attention_reference, q, k_pool, v_pool, tables, full,
                                iters=args.iters)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
        gbs = kv_bytes / seconds / 1e9
        tol = 1e-4 if dtype == jnp.float32 else 3e-2
        rows.append({
            "shape": {"batch": batch, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                      "block_size": block_size, "context": context, "dtype": jnp.dtype(dtype).name},
            "max_abs_err": err, "ok": err <= tol, "kernel_ms": 1e3 * seconds, "xla_ms": 1e3 * xla_seconds,
            "kv_gbytes": kv_bytes / 1e9, "achieved_gbs": gbs,
            "fraction_of_peak": None if peak is None else gbs / peak,
        })
    return {"ok": all(r["ok"] for r in rows), "shapes": rows}


def _score_inputs(shape, dtype):
    import jax
    import jax.numpy as jnp
    import numpy as np

    batch, query_len, q_heads, kv_heads, head_dim, block_size, width, m = shape
    rng = np.random.default_rng(1)
    num_pool_blocks = batch * width + 1
    kk, kq = jax.random.split(jax.random.key(1))
    k_pool = jax.random.normal(kk, (num_pool_blocks, block_size, kv_heads, head_dim), dtype)
    queries = jax.random.normal(kq, (batch, query_len, q_heads, head_dim), dtype)
    tables = np.zeros((batch, width), np.int32)
    counts = np.minimum(width, m + 1 + rng.integers(0, 3, batch)).astype(np.int32)
    counts[-1] = 0  # a padding row
    blocks = 1 + rng.permutation(batch * width)
    for b in range(batch):
        tables[b, :counts[b]] = blocks[b * width:b * width + counts[b]]
    return k_pool, queries, jnp.asarray(tables), jnp.asarray(counts)


def section_attention_score(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention_score import attention_score, attention_score_reference

    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    shape = SCORE_SHAPES[args.size]
    inputs = _score_inputs(shape, dtype)
    kernel = jax.jit(lambda *a: attention_score(*a, interpret=args.cpu_smoke))
    ours, ref = kernel(*inputs), attention_score_reference(*inputs)
    err = max_abs_err(ours, ref)
    return {
        "shape": dict(zip(("batch", "query_len", "q_heads", "kv_heads", "head_dim", "block_size", "width",
                           "budget_blocks"), shape)),
        "max_abs_err": err, "ok": err <= 1e-5,
        "kernel_ms": 1e3 * time_call(kernel, *inputs, iters=args.iters),
        "xla_ms": 1e3 * time_call(attention_score_reference, *inputs, iters=args.iters),
    }


def section_compact(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.compact import compact, compact_reference

    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    shape = SCORE_SHAPES[args.size]
    batch, _, _, kv_heads, head_dim, block_size, width, m = shape
    k_pool, _, tables, counts = _score_inputs(shape, dtype)
    v_pool = k_pool[::-1]
    scores = jax.random.uniform(jax.random.key(2), k_pool.shape[:3], jnp.float32)
    rng = np.random.default_rng(2)
    keep = np.zeros((batch, kv_heads, width * block_size), bool)
    for b, n in enumerate(np.asarray(counts)):
        for h in range(kv_heads if n else 0):
            keep[b, h, rng.choice(n * block_size, m * block_size, replace=False)] = True
    keep = jnp.asarray(keep.reshape(batch, kv_heads, width, block_size))
    targets = tables[:, :m]  # in place: each sequence's own first M blocks
    kernel = jax.jit(lambda *a: compact(*a, interpret=args.cpu_smoke))
    ours = kernel(k_pool, v_pool, scores, keep, tables, targets)
    ref = compact_reference(k_pool, v_pool, scores, keep, tables, targets)
    identical = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(ours, ref))
    moved = 2 * int(np.asarray(keep).sum()) * head_dim * jnp.dtype(dtype).itemsize  # K and V, read + write
    seconds = time_call(kernel, k_pool, v_pool, scores, keep, tables, targets, iters=args.iters)
    return {
        "shape": {"batch": batch, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size,
                  "width": width, "budget_blocks": m},
        "bit_identical": identical, "ok": identical, "kernel_ms": 1e3 * seconds,
        "xla_ms": 1e3 * time_call(compact_reference, k_pool, v_pool, scores, keep, tables, targets,
                                  iters=args.iters),
        "achieved_gbs": 2 * moved / seconds / 1e9,
    }


def section_compress_step(args) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from zipage_jax.compress.step import compress
    from zipage_jax.config import CompressionConfig

    layers, batch, query_len, q_heads, kv_heads, head_dim, block_size, m = COMPRESS_SHAPES[args.size]
    dtype = jnp.float32 if args.cpu_smoke else jnp.bfloat16
    cfg = CompressionConfig(budget_blocks=m, block_size=block_size, query_cache_len=query_len,
                            eviction_policy="zipage", use_global_score=True, enable_pooling=True,
                            redundancy="lightning")
    width = 1 << (m + 2 - 1).bit_length()  # the runner's bucket for M + 2 blocks
    rng = np.random.default_rng(3)
    num_pool_blocks = batch * (m + 2) + 1
    tables = np.zeros((batch, width), np.int32)
    tables[:, :m + 2] = 1 + rng.permutation(batch * (m + 2)).reshape(batch, m + 2)
    keys = jax.random.split(jax.random.key(3), 4 * layers)
    pool_shape = (num_pool_blocks, block_size, kv_heads, head_dim)
    k = [jax.random.normal(keys[4 * i], pool_shape, dtype) for i in range(layers)]
    v = [jax.random.normal(keys[4 * i + 1], pool_shape, dtype) for i in range(layers)]
    s = [jax.random.uniform(keys[4 * i + 2], pool_shape[:3], jnp.float32, 0, 0.01) for i in range(layers)]
    q = [jax.random.normal(keys[4 * i + 3], (batch, query_len, q_heads, head_dim), dtype) for i in range(layers)]
    args_ = (jnp.asarray(tables), jnp.full((batch,), m + 2, jnp.int32), jnp.arange(batch, dtype=jnp.int32),
             jnp.asarray(rng.random(batch) < 0.5), jnp.asarray(tables[:, :m + 1]))
    result = {"shape": {"layers": layers, "batch": batch, "kv_heads": kv_heads, "head_dim": head_dim,
                        "block_size": block_size, "budget_blocks": m, "blocks_per_seq": m + 2}}
    outputs = {}
    for backend in ("pallas-interpret" if args.cpu_smoke else "pallas", "xla"):
        step = jax.jit(functools.partial(compress, cfg=cfg, backend=backend))
        seconds = time_call(step, k, v, s, q, *args_, iters=args.iters)
        outputs[backend] = step(k, v, s, q, *args_)
        result[f"{backend}_ms"] = 1e3 * seconds
        result[f"{backend}_ms_per_layer"] = 1e3 * seconds / layers
    a, b = outputs.values()
    same = [float(np.mean(np.asarray(x) == np.asarray(y))) for x, y in zip(a[0], b[0])]
    result["k_pool_match_fraction"] = min(same)  # near-ties in the scores may pick other tokens
    result["ok"] = min(same) > 0.99
    return result


def section_throughput(args) -> dict:
    import bench_throughput as bt

    if args.cpu_smoke:
        workload = bt.Workload(requests=3, prompt_len_min=8, prompt_len_max=24, max_tokens=40, block_size=16,
                               budget_blocks=1, warmup_tokens=2)
    else:
        workload = bt.Workload(**{**bt.asdict(bt.PRESETS["default"]),
                                  **{k: v for k, v in (("requests", args.requests), ("max_tokens", args.max_tokens))
                                     if v is not None}})
    summary = bt.run_benchmark(workload, args.model, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    summary["ok"] = summary["speedup"] > 0
    return summary


SECTIONS = {
    "environment": section_environment,
    "paged_decode": section_paged_decode,
    "attention_score": section_attention_score,
    "compact": section_compact,
    "compress_step": section_compress_step,
    "throughput": section_throughput,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpreter, on the CPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all sections")
    parser.add_argument("--model", default="default", help="model for the throughput section")
    parser.add_argument("--requests", type=int, help="throughput section: requests (default: the preset's)")
    parser.add_argument("--max-tokens", type=int, help="throughput section: tokens per request")
    parser.add_argument("--peak-gbs", type=float, help="device memory bandwidth, GB/s (default: from the kind)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per kernel measurement")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    args.size = "smoke" if args.cpu_smoke else "gpu"
    if args.cpu_smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.iters = min(args.iters, 2)

    start = time.monotonic()
    report: dict = {"sections": {}}
    for name, fn in SECTIONS.items():
        if name == "throughput" and args.skip_throughput:
            continue
        left = args.budget_s - (time.monotonic() - start)
        t = time.monotonic()
        try:
            with deadline(left):
                result = fn(args)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            if isinstance(exc, KeyboardInterrupt):
                raise
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)[-3000:]}
        result["seconds"] = time.monotonic() - t
        report["sections"][name] = result
        print(json.dumps({"section": name, **result}), flush=True)
    report["ok"] = all(r.get("ok", True) for r in report["sections"].values())
    report["seconds"] = time.monotonic() - start
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
