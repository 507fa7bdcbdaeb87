"""Quality of compressed KV vs full KV when the PROMPT is long (compression during chunked prefill).

    zipage-jax eval long-prompt [--split dev|heldout] [--quick | --smoke] [--json]
                                [--policies vnorm-prompt] [--budgets 512]
                                [--modes bounded deferred chunk-queries]
                                [--lengths 4000 8000] [--depths ...] [--trials 1]
                                [--two-question-lengths 4000] [--doc-lengths 6000]
                                [--forced-tokens 256] [--chunk 512] [--timing-reps 3]

Every case is prefilled as a prompt in chunks of --chunk tokens (max_num_batched_tokens), once with
full KV and once per policy, budget and prompt-compression mode (`SamplingParams(kv_budget=tokens,
prompt_compression=...)`): "bounded" (the engine's default: compactions between chunks, each scored
by the prompt's last tokens), "deferred" (one compaction at the prompt's end) and "chunk-queries"
(bounded, each compaction scored by its own chunk's last queries, no pooling: the design before
question-aware scoring, kept as the baseline that misses the goals).
  (a) passkey: a random 5-digit key stated at a depth (a fraction of the prompt) inside a filler of
      --lengths tokens, the question at the end, then a few greedy tokens; correct = the key appears
      in them. relative_accuracy = of the cases full KV answers right, the share compressed also does.
  (b) two questions: a pass key and a door code at two depths, both asked for at the end and
      answered in one turn; correct = both appear in the answer.
  (c) continuation: the first --doc-lengths tokens of a long text as the prompt, the next
      --forced-tokens of it forced (`forced_token_ids`, logprobs=0); ppl_ratio = full-KV perplexity /
      compressed perplexity over the forced tokens (1.0 = no loss), as eval quality.
  (d) prefill time: each --lengths passkey prompt alone, one token generated, per mode and full KV,
      interleaved --timing-reps times; the median seconds and their ratio to full KV's.
Every row also gives each request's `kv_blocks_peak` and `num_compressions` (the engine's metrics)
and full KV's peak for the same cases, so the bound on KV memory during prefill shows.

The data are datasets.py's two splits: "dev" (tuned on): the passkey filler PASSKEY_FILLER, seed
0, depths 0.05, 0.15, ..., 0.95, and the dev texts (argparse.py, pydoc_data/topics.py); "heldout"
(never tuned on): a filler of the first held-out text of kind "license" (digits removed), another
seed, depths 0.1, 0.2, ..., 1.0, and the first held-out texts by the fixed rule (`heldout_sources`).
Policies, their engine options and the engine options' base are eval quality's (variants.py):
points that share engine options share one engine, full KV has its own. The pieces:
long_prompt_cases.py (the prompts) and long_prompt_report.py (rows and tables).
The last line with --json is {"results": [...], "prefill": [...], "workloads": {...}, "timings": {...}, "run": {...}}.
"""


from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np

from zipage_jax.evals.datasets import PASSKEY_DEPTHS, TWO_QUESTION_DEPTHS
from zipage_jax.evals.forcing import Job, job_result
from zipage_jax.evals.long_prompt_cases import FULL, Case, Outcome, Point, build_cases
from zipage_jax.evals.long_prompt_report import make_rows, markdown_tables, passkey_found
from zipage_jax.evals.variants import VARIANTS, group_engine_options
from zipage_jax.evals.variants import engine_group as variant_group
from zipage_jax.harness import add_output_arguments, build_llm, emit, log, timed, usage_error

DEFAULT_POLICIES = ["vnorm-prompt"]  # the engine's default
BUDGETS = (512,)  # kv_budget tokens
# prompt-compression designs: (SamplingParams.prompt_compression, engine options)
MODES = {
    "bounded": ("bounded", ()),
    "deferred": ("deferred", ()),
    "chunk-queries": ("bounded", (("prompt_window", 0), ("prompt_pooling_size", 1))),
}
DEFAULT_MODES = ["bounded", "deferred", "chunk-queries"]
LENGTHS = (4000, 8000)  # passkey prompt tokens
DOC_LENGTHS = (6000,)  # continuation prompt tokens


def engine_group(point: Point) -> tuple:
    """The engine options a point needs beyond the base: its policy's and its mode's."""
    policy, _, mode = point
    return variant_group(policy) + (MODES[mode][1] if mode in MODES else ())


def engine_kwargs(args: argparse.Namespace, group: tuple = ()) -> dict:
    """eval quality's engine options for `group`, with this evaluation's chunk and context length
    (and no prefix caching: every point prefills its prompt itself)."""
    base = group_engine_options(group, block_size=args.block_size, query_cache_len=args.query_cache_len,
                                longest=args.max_model_len - 64)
    return base | dict(max_num_batched_tokens=args.chunk, max_model_len=args.max_model_len, enable_prefix_caching=False)


def make_llm(loaded, args: argparse.Namespace, group: tuple, max_num_seqs: int):
    """An engine over the loaded model whose pool holds `max_num_seqs` full-KV sequences at once."""
    per_seq = -(-args.max_model_len // args.block_size) + 2
    return build_llm(loaded=loaded, num_kvcache_blocks=2 + max_num_seqs * per_seq, max_num_seqs=max_num_seqs,
                     **engine_kwargs(args, group))


def sampling_params(job: Job, point: Point, max_tokens: int | None = None):
    """forcing.run_jobs' greedy parameters for `job` at `point`."""
    from zipage_jax import SamplingParams

    policy, budget, mode = point
    return SamplingParams(temperature=0, max_tokens=max_tokens or len(job.forced) + job.free, ignore_eos=True,
                          logprobs=0, kv_budget=budget, eviction_policy=VARIANTS[policy].get("eviction_policy"),
                          forced_token_ids=job.forced if max_tokens is None else None,
                          prompt_compression=MODES[mode][0] if mode in MODES else None)


def generate(llm, jobs: list[Job], points: list[Point]) -> list[Outcome]:
    """Every job at once, keeping each request's metrics."""
    params = [sampling_params(job, point) for job, point in zip(jobs, points, strict=True)]
    outs = llm.generate([job.prompt for job in jobs], params, use_tqdm=False)
    return [Outcome(job_result(llm, job, out), dict(out["metrics"])) for job, out in zip(jobs, outs, strict=True)]


def run_points(loaded, args: argparse.Namespace, cases: list[Case], points: list[Point]) -> tuple[dict, dict]:
    """{(point, case index): Outcome} and seconds per engine group. One engine per group of points
    sharing engine options; per case, the group's points run at once (their decodes batch)."""
    outcomes: dict[tuple[Point, int], Outcome] = {}
    timings: dict[str, float] = {}
    groups = [engine_group(p) for p in points]
    for group in dict.fromkeys(groups):
        mine = [p for p, g in zip(points, groups, strict=True) if g == group]
        label = "+".join(dict.fromkeys(label_of(p) for p in mine))
        start = time.perf_counter()
        llm = make_llm(loaded, args, group, len(mine))
        for i, case in enumerate(cases):
            t = time.perf_counter()
            res = generate(llm, [case.job] * len(mine), mine)
            for point, out in zip(mine, res, strict=True):
                outcomes[point, i] = out
            where = f"{case.length} depth {case.depth}" if case.depth is not None else case.length
            log(f"  {label} {case.task} {where} {case.name}: {time.perf_counter() - t:.0f}s; "
                + ", ".join(f"{label_of(p)}@{p[1]}: {describe(case, o)}" for p, o in zip(mine, res, strict=True)))
        timings[label] = time.perf_counter() - start
        log(f"{label}: {timings[label]:.0f}s")
        del llm
        gc.collect()
    return outcomes, timings


def label_of(point: Point) -> str:
    return point[0] if point == FULL else f"{point[0]}/{point[2]}"


def prefill_timing(loaded, args: argparse.Namespace, cases: list[Case], points: list[Point]) -> list[dict]:
    """Per passkey length: its first prompt alone, one token generated, at every point and full KV,
    interleaved `args.timing_reps` times after one untimed run each; median seconds and the ratio to
    full KV's (the prefill dominates: one sampled token, no decode step)."""
    if not args.timing_reps:
        return []
    prompts = {c.length: c.job for c in cases if c.task == "passkey"}
    engines = {}
    for point in [FULL, *points]:
        engines.setdefault(engine_group(point), make_llm(loaded, args, engine_group(point), 1))
    rows = []
    for length, job in prompts.items():
        seconds: dict[Point, list[float]] = {p: [] for p in [FULL, *points]}
        peaks = {}
        for rep in range(args.timing_reps + 1):
            for point in seconds:
                llm = engines[engine_group(point)]
                start = time.perf_counter()
                out = llm.generate([job.prompt], sampling_params(job, point, max_tokens=1), use_tqdm=False)[0]
                if rep:  # the first run compiles
                    seconds[point].append(time.perf_counter() - start)
                peaks[point] = out["metrics"]["kv_blocks_peak"]
        full = float(np.median(seconds[FULL]))
        for point, times in seconds.items():
            median = float(np.median(times))
            rows.append({"split": args.split, "policy": point[0], "budget_tokens": point[1], "mode": point[2],
                         "length": length, "seconds": times, "median_seconds": median,
                         "ratio_to_full": median / full, "kv_blocks_peak": peaks[point]})
            log(f"  prefill {length} {label_of(point)}: median {median:.2f}s ({median / full:.3f}x full), "
                f"peak {peaks[point]}")
    return rows


def describe(case: Case, out: Outcome) -> str:
    m = out.metrics
    what = (f"{'ok' if passkey_found(case.job, out.result) else 'MISS'} {out.result.text.strip()[:40]!r}"
            if case.task != "continuation" else f"nll {-out.result.logprobs.sum():.1f}")
    return f"{what} peak {m.get('kv_blocks_peak')} comp {m.get('num_compressions')}"


# -- scoring -----------------------------------------------------------------------------------


def evaluate(args: argparse.Namespace) -> tuple[list[dict], list[dict], dict, dict]:
    """The rows, the prefill timings, a description of the workloads and the seconds of each part."""
    from zipage_jax.models.loading import load_model

    start = time.perf_counter()
    loaded = load_model(args.model)
    limit = loaded.config.max_position_embeddings
    args.max_model_len = min(args.max_model_len, limit)
    cases = build_cases(loaded.tokenizer, args)
    longest = max(len(c.job.prompt) + len(c.job.forced) + c.job.free for c in cases)
    if longest > args.max_model_len:
        raise ValueError(f"a case needs {longest} tokens; max_model_len is {args.max_model_len} (model: {limit})")
    points = [(p, b, m) for b in args.budgets for p in args.policies for m in args.modes]
    log(f"{args.split}: {len(cases)} cases, {len(points)} compressed points, chunk {args.chunk}, "
        f"block {args.block_size}, max_model_len {args.max_model_len}")
    outcomes, timings = run_points(loaded, args, cases, [FULL])
    more, more_timings = run_points(loaded, args, cases, points)
    outcomes |= more
    timings |= more_timings
    prefill, timings["prefill_timing"] = timed(lambda: prefill_timing(loaded, args, cases, points))
    timings["total"] = time.perf_counter() - start
    rows = make_rows(args, cases, points, outcomes)
    workloads = {"split": args.split, "block_size": args.block_size, "chunk": args.chunk,
                 "query_cache_len": args.query_cache_len, "max_model_len": args.max_model_len,
                 "model": loaded.source,
                 "cases": [{"task": c.task, "length": c.length, "depth": c.depth, "actual_depth": c.actual_depth,
                            "name": c.name, "workload": c.job.workload, "prompt_tokens": len(c.job.prompt),
                            "forced_tokens": len(c.job.forced), "free_tokens": c.job.free} for c in cases]}
    return rows, prefill, workloads, timings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--split", choices=("dev", "heldout"), default="heldout")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="about 10 min on 2 CPU cores: length 4000, 3 depths, no second question, one 3000-token "
                           "text, 128 forced, bounded and deferred, no timing")
    mode.add_argument("--smoke", action="store_true", help="a few tiny cases (for a tiny test model)")
    p.add_argument("--policies", nargs="+", default=None, choices=[v for v in VARIANTS if v != "full"],
                   help=f"default {' '.join(DEFAULT_POLICIES)}")
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="kv_budget tokens (default 512)")
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                   help=f"prompt-compression designs (default {' '.join(DEFAULT_MODES)})")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="passkey prompt tokens (default 4000 8000)")
    p.add_argument("--depths", nargs="+", type=float, default=None,
                   help="passkey depths (default: the split's ten, see the module docstring)")
    p.add_argument("--trials", type=int, default=None, help="passkeys per (length, depth) (default 1)")
    p.add_argument("--two-question-lengths", nargs="*", type=int, default=None,
                   help="prompt tokens of the two-question cases, four depth pairs each (default 4000; none: off)")
    p.add_argument("--timing-reps", type=int, default=None,
                   help="timed prefills per point and passkey length, interleaved (default 3; 0: off)")
    p.add_argument("--free-tokens", type=int, default=10, help="greedy tokens after a passkey question")
    p.add_argument("--doc-lengths", nargs="*", type=int, default=None,
                   help="continuation prompt tokens (default 6000; none: no continuation)")
    p.add_argument("--num-docs", type=int, default=None, help="continuation texts (default 2)")
    p.add_argument("--forced-tokens", type=int, default=None, help="continuation tokens forced (default 256)")
    p.add_argument("--block-size", type=int, default=None, help="default 32")
    p.add_argument("--query-cache-len", type=int, default=None, help="default 16")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk = max_num_batched_tokens (default 512)")
    p.add_argument("--max-model-len", type=int, default=8448, help="capped at the model's max_position_embeddings")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables here")
    add_output_arguments(p)  # --json: last line {"results", "prefill", "workloads", "timings", "run"}


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults of --smoke, --quick and the split, and refuses values out of range."""
    if args.smoke:
        defaults = dict(policies=["streaming"], budgets=[64], modes=["bounded"], lengths=[320], depths=[0.5],
                        two_question_lengths=[320], doc_lengths=[128], num_docs=1, forced_tokens=16, block_size=16,
                        query_cache_len=4, chunk=64, timing_reps=1)
    elif args.quick:
        defaults = dict(lengths=[4000], depths=[0.1, 0.5, 0.9], modes=["bounded", "deferred"],
                        two_question_lengths=[], doc_lengths=[3000], num_docs=1, forced_tokens=128, timing_reps=0)
    else:
        defaults = {}
    defaults = dict(policies=DEFAULT_POLICIES, budgets=list(BUDGETS), modes=DEFAULT_MODES, lengths=list(LENGTHS),
                    depths=list(PASSKEY_DEPTHS[args.split]), trials=1, two_question_lengths=[4000],
                    doc_lengths=list(DOC_LENGTHS), num_docs=1, forced_tokens=256, block_size=32,
                    query_cache_len=16, chunk=512, timing_reps=3) | defaults
    args.two_question_depths = TWO_QUESTION_DEPTHS[args.split]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if any(b < max(args.block_size, args.query_cache_len + 4) for b in args.budgets):
        usage_error("eval long-prompt",
                    f"budgets must hold at least a block ({args.block_size}) and the query cache + 4 tokens")
    if not all(0 <= d <= 1 for d in args.depths):
        usage_error("eval long-prompt", "depths are fractions in [0, 1]")
    if args.trials < 0 or args.num_docs < 0 or args.forced_tokens < 1 or args.timing_reps < 0:
        usage_error("eval long-prompt", "--trials, --num-docs and --timing-reps must be >= 0 and --forced-tokens >= 1")
    if not (args.trials and args.lengths and args.depths) and not (args.num_docs and args.doc_lengths):
        usage_error("eval long-prompt", "nothing to run")
    return args


def run(args: argparse.Namespace) -> int:
    args = resolve_arguments(args)
    rows, prefill, workloads, timings = evaluate(args)
    tables = markdown_tables(rows, prefill)
    print(tables)
    if args.markdown:
        Path(args.markdown).write_text(tables)
    if not (args.json or args.out):
        return 0
    return emit({"results": rows, "prefill": prefill, "workloads": workloads, "timings": timings}, args)
