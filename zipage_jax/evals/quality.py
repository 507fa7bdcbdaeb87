"""Quality of compressed KV vs full KV, through the engine's own decode path.

    zipage-jax eval quality [--quick] [--json] [--policies full streaming zipage-attn zipage ...]
                            [--budgets 0.0625 0.125 0.25 0.5] [--length 2048] [--text FILE ...]
                            [--reasoning-length 3072] [--split dev|heldout|both]
    zipage-jax eval quality --quick --json --memory-fractions 0.0625 0.125 0.25 \\
                            --kv-cache-dtypes auto int8 fp8 --policies streaming zipage vnorm-window
    zipage-jax eval quality --json --reasoning-only --budgets 0.125 --memory-fractions 0.125 \\
                            --kv-cache-dtypes auto int8      # long reasoning alone, tokens and bytes

Workloads, each run for every policy at every point, all sequences of one engine batched in one
`llm.generate` (per-request `kv_budget` and `eviction_policy`):
  (a) teacher-forced perplexity: a short prompt, then every further token is forced as the
      "sampled" token of a decode step, so compression happens exactly as in generation.
      texts: the first --length tokens (default 2048, 1024 with --quick) of files of the Python
      standard library and of the installed packages, or of --text FILE...;
      reasoning: multi-turn conversations of word problems ("Think step by step"), the answers
      written by the model itself with full KV (temperature 0.6, top-p 0.95, seeded), forced back;
      --reasoning-length tokens each (default 3072: the target workload is long reasoning), and
      the perplexity counts the answer tokens only;
  (b) passkey (dev only): a number stated early in a filler of --length tokens, forced through
      decode, then asked for at the end and generated greedily;
  (c) greedy agreement: after each forced text, the share of the next N greedy tokens identical
      to full KV's.
--reasoning-only runs the conversations alone; --no-texts, --no-passkeys, --no-reasoning drop one.
ppl_ratio = full-KV perplexity / compressed perplexity over the same tokens (1.0 = no loss).

Conversations: one `llm.generate` call per turn with every conversation of a split batched; turn
t of the conversation seeded s samples with seed 1000 s + t, and its prompt is the conversation's
tokens so far (the model's answers as it wrote them) plus the chat template's next user turn, so
the forced tokens are exactly what each answer was written after. A question is asked while its
prompt leaves >= 32 tokens of room (an answer takes at most 512 tokens); the question that leaves
less is the last: the room it leaves is its answer's start (end of answer suppressed), or, where it
does not fit, the question is cut, so every conversation is exactly --reasoning-length tokens.
Cached on disk (~/.cache/zipage_jax/reasoning-*) by every input: the model, the length, each
conversation's seed and problems, the turn rules.

Two data sets (--split). "dev" is what the policies were tuned on: argparse.py and
pydoc_data/topics.py, three conversations on DEV_PROBLEMS (seeds 0, 3, 6, the problems rotated by the
seed) and the passkeys. "heldout" is never tuned on: texts of five kinds picked by a fixed rule
(`heldout_sources`: per kind, the candidates in the order of a hash of their names, the first long
enough) and three conversations on the 24 HELDOUT_PROBLEMS (seeds 1, 2, 3, starting at problems 1,
9 and 17 and going round all 24, so none repeats within 24 turns). Every row is one split's numbers.
Both data sets are in datasets.py.

Budgets, per job: a point is a fraction, and each job's kv_budget is that fraction of its own
context (texts and passkeys at --length, reasoning at --reasoning-length), so workloads of
different lengths run in one batch at the same fraction.
  --budgets: a fraction of the context's tokens (kv dtype "auto"), rounded to whole blocks; or
    `auto`: kv_budget="auto" at the engine's defaults, whose memory is measured: its row gives each
    workload's mean peak KV (`kv_blocks_peak`) as its budget_tokens, of the workload's mean context.
  --memory-fractions: a fraction of the full KV's bytes in bfloat16, what a GPU stores ("auto"
    counts as bfloat16 here, though this CPU computes in float32), for every --kv-cache-dtypes
    entry (any of pallas_kernels.kv_quant.KV_CACHE_DTYPES). A quantized pool (int8 or fp8: one byte
    per value plus one float32 scale per token per kv head; its bytes per token are the pool's own,
    `kv_token_bytes`) then keeps fraction * context * bf16_bytes / its_bytes tokens, rounded down to
    whole blocks, so no point uses more memory than its fraction. Quantized pools also run with full
    KV (the cost of quantization alone).
Both may be given in one run: every point of one engine (policy options, kv dtype) runs in one
batch. The reference perplexity is the float32 full-KV run. Every row gives, per workload, the
context, budget_tokens, kept_fraction (budget_tokens / context) and the memory as fractions of the
bf16 and of the f32 full KV (what this run stored), so a row reads as tokens and as bytes; the
flat fields are those of its first workload (text, else reasoning, else passkey).

Rows: one per (policy, kv dtype, fraction kind, fraction, split). The markdown has one table per
fraction kind, held-out cells with dev in parentheses, and the context lengths. The last line with
--json is {"results": [{"policy", "kv_cache_dtype", "fraction_kind", "fraction", "split",
"ppl_ratio", "reasoning_ppl_ratio", "by_workload", ...}, ...], "workloads": {...}, "lengths": {...}}.

Teacher forcing is the engine's own: `SamplingParams(forced_token_ids=...)` decodes the forced
tokens one per step (so compression runs as in generation) and reports their log-probabilities
from the full distribution. Policies that differ only in `eviction_policy` (a per-request
option) share one engine; the others get one engine each (see variants.py), and so does each
kv_cache_dtype. Full-KV results are cached on disk by the model and the jobs.

The pieces: quality_jobs.py (the workloads), forcing.py (teacher forcing, engines), quality_budgets.py
(budgets per job), scoring.py and quality_report.py (rows and tables).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pallas_kernels.kv_quant import KV_CACHE_DTYPES
from zipage_jax.compress.auto_budget import AUTO
from zipage_jax.evals.datasets import DEV_TEXTS, HELDOUT_KINDS, HELDOUT_PER_KIND
from zipage_jax.evals.forcing import WORKLOADS, full_kv_results, run_batch, workload_of
from zipage_jax.evals.quality_budgets import (
    Point,
    budget_fraction,
    budget_tokens,
    fraction_kinds,
    memory_budget_tokens,
    plan_points,
    point_budgets,
)
from zipage_jax.evals.quality_jobs import PROMPT_TOKENS, REASONING_LENGTH, build_jobs, workload_lengths
from zipage_jax.evals.quality_report import format_row, markdown_table, point_rows
from zipage_jax.evals.scoring import nll
from zipage_jax.evals.variants import VARIANTS
from zipage_jax.harness import add_output_arguments, emit, log, usage_error

DEFAULT_POLICIES = ["full", "streaming", "zipage-attn", "zipage", "window", "vnorm-window", "vnorm-prompt"]
MEMORY_POLICIES = ["streaming", "zipage", "vnorm-prompt"]
BUDGETS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
MEMORY_FRACTIONS = (1 / 16, 1 / 8, 1 / 4)


def evaluate(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """One engine run for full KV (cached), then, per kv dtype, one engine per engine group running
    every point of the group on every job at once. Returns the rows and a description of the workloads."""
    from zipage_jax.models.loading import load_model

    loaded = load_model(args.model)
    jobs = build_jobs(loaded, args)
    if not jobs:
        raise ValueError("no jobs: every workload is switched off")
    points = plan_points(args)
    references = [Point("full", "auto", kind, 1.0) for kind in fraction_kinds(args)]
    budgets = point_budgets(references + points, jobs, loaded.config, args)
    lengths = {w: max(j.context for j in jobs if workload_of(j) == w) for w in WORKLOADS
               if any(workload_of(j) == w for j in jobs)}
    log(f"{len(jobs)} jobs ({', '.join(f'{w} {n} tokens' for w, n in lengths.items())}), {len(points)} points")

    full, seconds = full_kv_results(loaded, args, jobs)
    log(f"full KV: {seconds:.0f}s")
    rows = [row for point in references for row in point_rows(point, jobs, full, full, budgets[point], loaded)]
    n = len(jobs)
    for dtype in dict.fromkeys(p.kv_cache_dtype for p in points):
        mine = [p for p in points if p.kv_cache_dtype == dtype]
        runs = list(dict.fromkeys((p.policy, tuple(budgets[p])) for p in mine))  # equal budgets run once
        results, seconds = run_batch(loaded, args, [j for _ in runs for j in jobs], [b for _, bs in runs for b in bs],
                                     [policy for policy, _ in runs for _ in jobs], kv_cache_dtype=dtype)
        for point in mine:
            k = runs.index((point.policy, tuple(budgets[point])))
            for row in point_rows(point, jobs, results[k * n:(k + 1) * n], full, budgets[point], loaded):
                rows.append(row)
                log(format_row(row))
        log(f"{dtype}: {len(runs)} runs of {n} jobs in {seconds:.0f}s")
    workloads = {"context": max(lengths.values()), "lengths": lengths, "length": args.length,
                 "reasoning_length": args.reasoning_length if "reasoning" in lengths else None,
                 "block_size": args.block_size, "query_cache_len": args.query_cache_len,
                 "jobs": [{"name": j.workload, "kind": j.kind, "split": j.split, "context": j.context,
                           "scored_tokens": nll(j, full[i])[1]} for i, j in enumerate(jobs)]}
    return rows, workloads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true",
                   help="texts and passkeys of 1024 tokens; without --memory-fractions also one text, 2 passkeys, "
                        "budget 1/8 only (the conversations keep --reasoning-length)")
    p.add_argument("--policies", nargs="+", default=None, choices=list(VARIANTS),
                   help=f"default {' '.join(DEFAULT_POLICIES)}; with --memory-fractions {' '.join(MEMORY_POLICIES)}")
    p.add_argument("--budgets", nargs="+", type=budget_fraction, default=None,
                   help="fractions of each job's context in tokens (kv dtype auto), or auto (kv_budget=\"auto\", "
                        "its peak KV measured); may go with --memory-fractions")
    p.add_argument("--memory-fractions", nargs="+", type=float, default=None,
                   help="equal memory: budgets as fractions of the full KV's bytes in bfloat16 "
                        "(e.g. 0.0625 0.125 0.25)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                   help="with --memory-fractions: the pools measured (quantized ones also with full KV)")
    p.add_argument("--split", choices=("dev", "heldout", "both"), default=None,
                   help="data set: dev (tuned on), heldout (never tuned on) or both; "
                        "default dev, both with --memory-fractions")
    p.add_argument("--heldout-per-kind", type=int, default=HELDOUT_PER_KIND,
                   help=f"held-out texts of each kind ({', '.join(HELDOUT_KINDS)})")
    p.add_argument("--length", type=int, default=None,
                   help="context tokens of each text and passkey (default 2048, 1024 with --quick)")
    p.add_argument("--reasoning-length", type=int, default=REASONING_LENGTH,
                   help=f"tokens of each reasoning conversation (default {REASONING_LENGTH})")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="evaluate (a) on these files only")
    p.add_argument("--num-texts", type=int, default=len(DEV_TEXTS))
    p.add_argument("--passkey-trials", type=int, default=None)
    p.add_argument("--no-reasoning", dest="reasoning", action="store_false", help="no conversations")
    p.add_argument("--no-texts", dest="texts", action="store_false", help="no texts (nor their greedy agreement)")
    p.add_argument("--no-passkeys", dest="passkeys", action="store_false", help="no passkeys")
    p.add_argument("--reasoning-only", action="store_true", help="the conversations alone: no texts, no passkeys")
    p.add_argument("--block-size", type=int, default=None,
                   help="default 32; 16 with --memory-fractions (int8 budgets within a block of their memory)")
    p.add_argument("--query-cache-len", type=int, default=16)
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables here")
    add_output_arguments(p)  # --json: last line {"results": [...], "workloads": {...}, "lengths": {...}, "run"}


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on other flags (--quick, --memory-fractions, --split) and
    refuses flags that do not go together or budgets too small for a workload."""
    def error(message: str):
        usage_error("eval quality", message)

    quick, memory = args.quick, bool(args.memory_fractions)
    if args.kv_cache_dtypes != ["auto"] and not memory:
        error("--kv-cache-dtypes needs --memory-fractions")
    if args.reasoning_only:
        if not args.reasoning:
            error("--reasoning-only and --no-reasoning leave nothing to run")
        if args.text:
            error("--text evaluates the files alone; it does not go with --reasoning-only")
        if args.passkey_trials:
            error("--reasoning-only runs no passkeys; drop --passkey-trials")
        args.texts = args.passkeys = False
    args.policies = args.policies or (MEMORY_POLICIES if memory else DEFAULT_POLICIES)
    args.split = args.split or ("both" if memory else "dev")
    args.block_size = args.block_size or (16 if memory else 32)
    args.length = args.length or (1024 if quick else 2048)
    args.budgets = args.budgets or ([] if memory else [1 / 8] if quick else list(BUDGETS))
    default_trials = 0 if memory else 2 if quick else 4
    args.passkey_trials = args.passkey_trials if args.passkey_trials is not None else default_trials
    if not args.passkeys or args.split == "heldout":  # passkeys are dev only
        args.passkey_trials = 0
    if quick and not memory and args.num_texts == len(DEV_TEXTS):
        args.num_texts = 1
    fractions = [f for f in args.budgets if f != AUTO]
    for f in [*fractions, *(args.memory_fractions or ())]:
        if not 0 < f < 1:
            error(f"budgets and memory fractions are fractions in (0, 1), got {f}")
    if args.heldout_per_kind < 0:
        error(f"--heldout-per-kind must be >= 0, got {args.heldout_per_kind}")
    for name in args.text or ():
        if not Path(name).is_file():
            error(f"--text: no such file {name}")
    for option, value in (("--length", args.length), ("--reasoning-length", args.reasoning_length)):
        if value < 4 * PROMPT_TOKENS:
            error(f"{option} must be at least {4 * PROMPT_TOKENS} tokens, got {value}")
    lengths = workload_lengths(args)
    if not lengths:
        error("no workload left: texts, passkeys and reasoning are all switched off")
    args.max_context = max(lengths.values())
    for workload, length in lengths.items():  # bf16 holds the fewest tokens of every kv dtype at a memory fraction
        try:
            for f in fractions:
                budget_tokens(f, length, args.block_size, args.query_cache_len)
            for f in args.memory_fractions or ():
                memory_budget_tokens(f, length, 1, 1, args.block_size, args.query_cache_len)
        except ValueError as exc:
            error(f"{workload} at {length} tokens: {exc}")
    return args


def run(args: argparse.Namespace) -> int:
    args = resolve_arguments(args)
    rows, workloads = evaluate(args)
    table = markdown_table(rows, workloads["lengths"])
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if not (args.json or args.out):
        return 0
    return emit({"results": rows, "workloads": workloads, "lengths": workloads["lengths"]}, args)
