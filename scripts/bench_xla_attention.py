"""The XLA paged decode attention's time per call against its keys per loop step.

    python scripts/bench_xla_attention.py [--cases 16x96 64x512 ...] [--steps 64 128 256 512 1024] [--json]

One decode token per row (the default model's 9 query / 3 kv heads, head dim 64, pages of 32),
every row at the same context; each case times every step size, calls interleaved, median of
--runs. The column marked * is what `tokens_per_step` picks. The last line with --json is
{"cases": [{"batch", "context", "default_step", "ms": {step: ms}}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def time_case(batch: int, context: int, steps: list[int], runs: int, heads=(9, 3, 64), page=32,
              table_width=64) -> dict:
    import jax.numpy as jnp

    from bench_gpu import decode_inputs
    from pallas_kernels.kv_pool import KVPool
    from pallas_kernels.xla_attention import paged_attention, tokens_per_step

    if -(-context // page) > table_width:
        raise ValueError(f"context {context} needs more pages than the table width {table_width}")
    q, k_pool, v_pool, tables = decode_inputs(0, batch, heads, page, context, jnp.float32)
    q, pools = q[:, None], KVPool(k_pool, v_pool)  # one decode token per row
    tables = jnp.pad(tables, ((0, 0), (0, table_width - tables.shape[1])))  # padded with the dummy page 0
    lens = jnp.full((batch, 1), context, jnp.int32)

    def call(step: int) -> float:
        start = time.perf_counter()
        paged_attention(q, pools, tables, lens, step_tokens=step)[0].block_until_ready()
        return time.perf_counter() - start

    for step in steps:  # compile
        call(step)
    times: dict[int, list[float]] = {s: [] for s in steps}
    for _ in range(runs):
        for step in steps:
            times[step].append(call(step))
    return {"batch": batch, "context": context, "default_step": tokens_per_step(batch, 1, heads[0], page),
            "ms": {str(s): 1e3 * statistics.median(t) for s, t in times.items()}}


def parse_case(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxCONTEXT, e.g. 16x96; got {text!r}") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be >= 1, got {text!r}")
    return batch, context


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", type=parse_case,
                   default=[parse_case(c) for c in ("1x96", "1x1024", "8x96", "16x96", "16x512", "64x96", "64x512")])
    p.add_argument("--steps", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if any(s < 32 or s % 32 for s in args.steps):
        p.error("--steps must be multiples of the page size, 32")
    rows = []
    for batch, context in args.cases:
        row = time_case(batch, context, args.steps, args.runs)
        rows.append(row)
        cells = " ".join(f"{s}{'*' if int(s) == row['default_step'] else ''}: {ms:.3f}" for s, ms in row["ms"].items())
        print(f"batch {batch:3d} context {context:5d}  ms by step  {cells}", file=sys.stderr, flush=True)
    if args.json:
        from zipage_jax.run_info import run_info

        print(json.dumps({"cases": rows, "run": run_info()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
