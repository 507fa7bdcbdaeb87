"""eval quality's budgets: each job's kv_budget at a point, from a fraction of its own context.

  tokens   a fraction of the context's tokens (kv dtype "auto"), rounded to whole blocks
  memory   a fraction of the full KV's bytes in bfloat16 (what a GPU stores); a pool of another kv
           dtype keeps fraction * context * bf16_bytes / its_bytes tokens (kv_token_bytes: values
           and scales), rounded down to whole blocks, so no point uses more memory than its fraction
  auto     kv_budget="auto": the engine sizes each budget as it goes; its memory is measured (each
           job's peak KV), not set
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from zipage_jax.compress.auto_budget import AUTO, Budget
from zipage_jax.evals.forcing import Job, workload_of

FRACTION_KINDS = ("tokens", "auto", "memory")  # --budgets fractions, --budgets auto, --memory-fractions


@dataclass(frozen=True)
class Point:
    """One measured configuration: every job runs once with it, at its own budget (job_budget)."""

    policy: str
    kv_cache_dtype: str
    fraction_kind: str  # "tokens": of each job's context (--budgets); "memory": of its bf16 full KV's bytes;
    # "auto": kv_budget="auto"
    fraction: float  # 1.0 with full KV, 0.0 with an automatic budget (its memory is measured)


def budget_fraction(text: str) -> float | str:
    """A --budgets entry: a fraction of the context, or AUTO."""
    return AUTO if text == AUTO else float(text)


def budget_tokens(fraction: float, context: int, block_size: int, query_cache_len: int) -> int:
    """`fraction` of `context` tokens, rounded to whole blocks (at least one)."""
    tokens = max(block_size, round(fraction * context / block_size) * block_size)
    if tokens < query_cache_len + 4:
        raise ValueError(f"budget {fraction:.4g} of {context} tokens is {tokens} tokens: too small for the protected "
                         f"tokens (the query cache's {query_cache_len} + 4)")
    return tokens


def kv_token_bytes(model_config, kv_cache_dtype: str, auto_dtype) -> int:
    """Pool bytes of one token, K and V of every layer, scales included; "auto" stored as `auto_dtype`."""
    from pallas_kernels.kv_quant import kv_storage_dtype
    from zipage_jax.engine.pool_plan import kv_block_bytes

    mc = model_config
    return kv_block_bytes(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, kv_storage_dtype(kv_cache_dtype, auto_dtype))


def memory_budget_tokens(fraction: float, context: int, token_bytes: int, reference_bytes: int, block_size: int,
                         query_cache_len: int) -> int:
    """Tokens that `fraction` of a full KV of `context` tokens at `reference_bytes` each holds at
    `token_bytes` each, rounded down to whole blocks (a point never uses more than its memory)."""
    tokens = math.floor(fraction * context * reference_bytes / token_bytes + 1e-9) // block_size * block_size
    if tokens < max(block_size, query_cache_len + 4):
        raise ValueError(f"memory fraction {fraction:.4g} of {context} tokens holds {tokens} tokens at {token_bytes} "
                         f"bytes each: too few for the protected tokens (a block of {block_size}, the query "
                         f"cache's {query_cache_len} + 4)")
    return tokens


def job_budget(point: Point, context: int, model_config, block_size: int, query_cache_len: int) -> Budget:
    """kv_budget of a job of `context` tokens at `point`: tokens (0: full KV), or AUTO."""
    import jax.numpy as jnp

    if point.policy == "full":
        return 0
    if point.fraction_kind == "auto":
        return AUTO
    if point.fraction_kind == "tokens":
        return budget_tokens(point.fraction, context, block_size, query_cache_len)
    token_bytes = kv_token_bytes(model_config, point.kv_cache_dtype, jnp.bfloat16)
    reference_bytes = kv_token_bytes(model_config, "auto", jnp.bfloat16)
    return memory_budget_tokens(point.fraction, context, token_bytes, reference_bytes, block_size, query_cache_len)


def point_budgets(points: list[Point], jobs: list[Job], model_config,
                  args: argparse.Namespace) -> dict[Point, list[Budget]]:
    """Each point's kv_budget of every job, from the job's own context; raises ValueError naming the
    workload and its length where a budget cannot hold the protected tokens."""
    budgets: dict[Point, list[Budget]] = {}
    for point in points:
        budgets[point] = []
        for job in jobs:
            try:
                budgets[point].append(job_budget(point, job.context, model_config, args.block_size,
                                                 args.query_cache_len))
            except ValueError as exc:
                raise ValueError(f"{point.policy} {point.kv_cache_dtype} at {point.fraction_kind} fraction "
                                 f"{point.fraction:.4g}, {workload_of(job)} job {job.workload} ({job.context} "
                                 f"tokens): {exc}") from exc
    return budgets


def budget_fields(model_config, point: Point, context: int, budget: int, model_dtype) -> dict:
    """A job's budget as tokens and as memory: of the full KV's bytes in bfloat16 and in float32 (as this
    run stored it: "auto" is the model dtype)."""
    import jax.numpy as jnp

    kept = budget or context
    bf16 = kv_token_bytes(model_config, "auto", jnp.bfloat16)
    f32 = kv_token_bytes(model_config, "auto", jnp.float32)
    mine_bf16 = kv_token_bytes(model_config, point.kv_cache_dtype, jnp.bfloat16)
    mine_stored = kv_token_bytes(model_config, point.kv_cache_dtype, model_dtype)
    return {
        "context": context,
        "budget_tokens": kept,
        "kept_fraction": kept / context,
        "memory_fraction_bf16": kept * mine_bf16 / (context * bf16),
        "memory_fraction_f32": kept * mine_stored / (context * f32),
    }


def fraction_kinds(args: argparse.Namespace) -> list[str]:
    given = ([f for f in args.budgets if f != AUTO], AUTO in args.budgets, args.memory_fractions)
    return [kind for kind, on in zip(FRACTION_KINDS, given, strict=True) if on]


def plan_points(args: argparse.Namespace) -> list[Point]:
    """The compressed points: every policy at every --budgets fraction or "auto" (kv dtype auto); with
    --memory-fractions, per kv dtype its full KV (quantization alone; not for auto) and every policy at
    every memory fraction."""
    policies = [p for p in args.policies if p != "full"]
    points = [Point(p, "auto", "auto", 0.0) if f == AUTO else Point(p, "auto", "tokens", f)
              for f in args.budgets for p in policies]
    for dtype in args.kv_cache_dtypes if args.memory_fractions else ():
        if dtype != "auto":
            points.append(Point("full", dtype, "memory", 1.0))
        points += [Point(p, dtype, "memory", f) for f in args.memory_fractions for p in policies]
    return points
