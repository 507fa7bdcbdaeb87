"""The XLA paged decode attention's time per call against its keys per loop step.

    zipage-jax bench xla-attention [--cases 16x96 64x512 ...] [--steps 64 128 256 512 1024] [--json] [--out PATH]

One decode token per row (the default model's 9 query / 3 kv heads, head dim 64, pages of 32),
every row at the same context; each case times every step size, calls interleaved, median of
--runs. The column marked * is what `tokens_per_step` picks. The last line with --json is
{"cases": [{"batch", "context", "default_step", "ms": {step: ms}}, ...]}.
"""

from __future__ import annotations

import argparse

from zipage_jax.bench.gpu import decode_inputs
from zipage_jax.harness import add_output_arguments, emit, interleaved_medians, log, usage_error

DEFAULT_CASES = ("1x96", "1x1024", "8x96", "16x96", "16x512", "64x96", "64x512")


def time_case(batch: int, context: int, steps: list[int], runs: int, heads=(9, 3, 64), page=32,
              table_width=64) -> dict:
    import jax.numpy as jnp

    from pallas_kernels.kv_pool import KVPool
    from zipage_jax.layers.xla_paged_attention import paged_attention, tokens_per_step

    if -(-context // page) > table_width:
        raise ValueError(f"context {context} needs more pages than the table width {table_width}")
    q, k_pool, v_pool, tables = decode_inputs(0, batch, heads, page, context, jnp.float32)
    q, pools = q[:, None], KVPool(k_pool, v_pool)  # one decode token per row
    tables = jnp.pad(tables, ((0, 0), (0, table_width - tables.shape[1])))  # padded with the dummy page 0
    lens = jnp.full((batch, 1), context, jnp.int32)

    def call(step: int):
        return lambda: paged_attention(q, pools, tables, lens, step_tokens=step)[0].block_until_ready()

    calls = {str(s): call(s) for s in steps}
    for fn in calls.values():  # compile
        fn()
    seconds = interleaved_medians(calls, runs)
    return {"batch": batch, "context": context, "default_step": tokens_per_step(batch, 1, heads[0], page),
            "ms": {s: 1e3 * t for s, t in seconds.items()}}


def parse_case(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxCONTEXT, e.g. 16x96; got {text!r}") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be >= 1, got {text!r}")
    return batch, context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--steps", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--runs", type=int, default=15)
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if any(s < 32 or s % 32 for s in args.steps):
        usage_error("bench xla-attention", "--steps must be multiples of the page size, 32")
    rows = []
    for batch, context in args.cases:
        row = time_case(batch, context, args.steps, args.runs)
        rows.append(row)
        cells = " ".join(f"{s}{'*' if int(s) == row['default_step'] else ''}: {ms:.3f}" for s, ms in row["ms"].items())
        log(f"batch {batch:3d} context {context:5d}  ms by step  {cells}")
    return emit({"cases": rows}, args)
