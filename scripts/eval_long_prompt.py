"""Quality of compressed KV vs full KV when the PROMPT is long (compression during chunked prefill).

    python scripts/eval_long_prompt.py [--split dev|heldout] [--quick | --smoke] [--json]
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
      compressed perplexity over the forced tokens (1.0 = no loss), as scripts/eval_quality.py.
  (d) prefill time: each --lengths passkey prompt alone, one token generated, per mode and full KV,
      interleaved --timing-reps times; the median seconds and their ratio to full KV's.
Every row also gives each request's `kv_blocks_peak` and `num_compressions` (the engine's metrics)
and full KV's peak for the same cases, so the bound on KV memory during prefill shows.

The data come from eval_quality's two splits: "dev" (tuned on): its passkey filler, seed 0, depths
0.05, 0.15, ..., 0.95, and its dev texts (argparse.py, pydoc_data/topics.py); "heldout" (never tuned
on): a filler of the first held-out text of kind "license" (digits removed), another seed, depths
0.1, 0.2, ..., 1.0, and the first held-out texts by eval_quality's fixed rule (`heldout_sources`).
Policies, their engine options and the engine options' base are eval_quality's (VARIANTS,
engine_group, engine_options): points that share engine options share one engine, full KV has its own.
The last line with --json is {"results": [...], "prefill": [...], "workloads": {...}, "timings": {...}, "run": {...}}.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # eval_quality, run_info: beside this script


import eval_quality as eq  # noqa: E402

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
DEPTHS = {"dev": tuple(round(0.05 + 0.1 * i, 2) for i in range(10)),  # where the key is stated, of the prompt
          "heldout": tuple(round(0.1 * (i + 1), 2) for i in range(10))}
TWO_QUESTION_DEPTHS = {"dev": ((0.15, 0.65), (0.35, 0.85), (0.55, 0.25), (0.75, 0.45)),
                       "heldout": ((0.1, 0.6), (0.3, 0.8), (0.5, 0.2), (0.9, 0.4))}
DOC_LENGTHS = (6000,)  # continuation prompt tokens
SEEDS = {"dev": 0, "heldout": 1}  # passkey keys
INTRO = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there. ")  # eval_quality's passkey wording
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
SECOND_NEEDLE = " The door code is {key}. Remember it. {key} is the door code. "
TWO_QUESTIONS = " What is the pass key, and what is the door code? The pass key is"
TWO_QUESTION_FREE = 32  # greedy tokens answering both
PROMPT_WINDOW = 32  # the engine's default prompt_window: the tail's tokens
SENTENCE_END = re.compile(r"[.!?\n]")


@dataclass
class Case:
    """One prompt of one task: `job` (eval_quality's Job) runs once per point."""

    task: str  # "passkey" or "continuation"
    split: str
    length: int  # prompt tokens
    depth: float | tuple[float, float] | None  # passkey: asked for (two-question: both); None for continuation
    name: str  # passkey: "trial<k>"; two-question: the depths; continuation: the text's name
    job: eq.Job
    actual_depth: float | tuple[float, ...] | None = None  # where each needle starts, of the prompt


@dataclass
class Outcome:
    result: eq.JobResult
    metrics: dict = field(default_factory=dict)


# -- workloads ---------------------------------------------------------------------------------


def filler_text(split: str, tokenizer) -> tuple[str, str]:
    """(name, text) of the split's passkey filler: eval_quality's for dev; for held-out, the first
    held-out text of kind "license" by eval_quality's rule, digits removed (no other number)."""
    if split == "dev":
        return "eval_quality.PASSKEY_FILLER", eq.PASSKEY_FILLER
    licenses = {"license": eq.heldout_candidates()["license"]}
    (src,) = eq.heldout_sources(tokenizer, per_kind=1, min_tokens=1024, candidates=licenses)
    return src.name, re.sub(r"[ \t]+", " ", re.sub(r"\d", "", src.text))


def sentence_ends(tokenizer, filler: list[int]) -> list[bool]:
    """Per filler token: it ends a sentence or a line (the needle may follow it)."""
    return [bool(SENTENCE_END.search(tokenizer.decode([t]))) for t in filler]


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: str,
                   ends: list[bool] | None = None) -> tuple[list[int], float]:
    """Exactly `length` tokens: INTRO, filler, the needle after the last sentence end before `depth`
    of the prompt (at `depth` if none is within 256 tokens), more filler, QUESTION. Returns the ids
    and where the needle starts, as a fraction of the prompt."""
    ids, (actual,) = needle_prompt(tokenizer, filler, length, [(depth, NEEDLE.format(key=key))], QUESTION, ends)
    return ids, actual


def needle_prompt(tokenizer, filler: list[int], length: int, needles: list[tuple[float, str]], question: str,
                  ends: list[bool] | None = None) -> tuple[list[int], list[float]]:
    """Exactly `length` tokens: INTRO, filler with each needle after the last sentence end before its
    depth, the question. Returns the ids and where each needle starts, as a fraction of the prompt."""
    intro = tokenizer(INTRO)["input_ids"]
    texts = [tokenizer(text)["input_ids"] for _, text in needles]
    question_ids = tokenizer(question)["input_ids"]
    room = length - len(intro) - sum(map(len, texts)) - len(question_ids)
    if room < 1:
        raise ValueError(f"a passkey prompt of {length} tokens has no room for filler")
    hay = (filler * (room // len(filler) + 1))[:room]
    ends = sentence_ends(tokenizer, filler) if ends is None else ends
    cuts = []
    for depth, _ in needles:
        target = min(room, max(0, round(depth * length) - len(intro)))  # depth: of the prompt
        cuts.append(next((i + 1 for i in range(target - 1, max(-1, target - 257), -1) if ends[i % len(filler)]),
                         target))
    ids, starts, done = list(intro), [0.0] * len(needles), 0
    for i in sorted(range(len(needles)), key=lambda i: cuts[i]):
        ids += hay[done:cuts[i]]
        starts[i] = len(ids) / length
        ids += texts[i]
        done = cuts[i]
    return ids + hay[done:] + question_ids, starts


def passkey_cases(tokenizer, split: str, lengths, depths, trials: int, free: int) -> list[Case]:
    if not (lengths and depths and trials):
        return []
    name, text = filler_text(split, tokenizer)
    filler = tokenizer(text)["input_ids"]
    ends = sentence_ends(tokenizer, filler)
    rng = random.Random(SEEDS[split])
    cases = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                key = str(rng.randint(10000, 99999))
                ids, actual = passkey_prompt(tokenizer, filler, length, depth, key, ends)
                job = eq.Job(f"passkey:{name}", ids, [], free=free, answer=key, kind="passkey", split=split)
                cases.append(Case("passkey", split, length, depth, f"trial{trial}", job, actual))
    return cases


def two_question_cases(tokenizer, split: str, lengths, pairs) -> list[Case]:
    """A pass key and a door code at the depths of each pair, both asked for at the end."""
    if not (lengths and pairs):
        return []
    name, text = filler_text(split, tokenizer)
    filler = tokenizer(text)["input_ids"]
    ends = sentence_ends(tokenizer, filler)
    rng = random.Random(SEEDS[split] + 100)
    cases = []
    for length in lengths:
        for first, second in pairs:
            keys = [str(rng.randint(10000, 99999)) for _ in range(2)]
            needles = [(first, NEEDLE.format(key=keys[0])), (second, SECOND_NEEDLE.format(key=keys[1]))]
            ids, actual = needle_prompt(tokenizer, filler, length, needles, TWO_QUESTIONS, ends)
            job = eq.Job(f"two-question:{name}", ids, [], free=TWO_QUESTION_FREE, answer=" ".join(keys),
                         kind="passkey", split=split)
            cases.append(Case("two-question", split, length, (first, second), f"{first:g}+{second:g}", job,
                              tuple(actual)))
    return cases


def continuation_sources(tokenizer, split: str, num_docs: int, min_tokens: int) -> list[eq.Source]:
    if split == "dev":
        sources = eq.dev_sources(num_docs)
    else:
        sources = eq.heldout_sources(tokenizer, per_kind=1, min_tokens=min_tokens)[:num_docs]
    for src in sources:
        n = len(tokenizer(src.text)["input_ids"])
        if n < min_tokens:
            raise ValueError(f"{src.name} has {n} tokens; the continuation needs {min_tokens}")
    return sources


def continuation_cases(tokenizer, split: str, doc_lengths, forced: int, num_docs: int) -> list[Case]:
    if not doc_lengths or num_docs == 0:
        return []
    cases = []
    for src in continuation_sources(tokenizer, split, num_docs, max(doc_lengths) + forced):
        ids = tokenizer(src.text)["input_ids"]
        for length in doc_lengths:
            job = eq.Job(f"text:{src.name}", ids[:length], ids[length:length + forced], kind=src.kind, split=split)
            cases.append(Case("continuation", split, length, None, src.name, job))
    return cases


def build_cases(tokenizer, args) -> list[Case]:
    return (passkey_cases(tokenizer, args.split, args.lengths, args.depths, args.trials, args.free_tokens)
            + two_question_cases(tokenizer, args.split, args.two_question_lengths, args.two_question_depths)
            + continuation_cases(tokenizer, args.split, args.doc_lengths, args.forced_tokens, args.num_docs))


# -- running -----------------------------------------------------------------------------------


Point = tuple[str, int, str]  # (policy, kv_budget tokens, mode); full KV is ("full", 0, "full")
FULL: Point = ("full", 0, "full")


def engine_group(point: Point) -> tuple:
    """The engine options a point needs beyond the base: its policy's and its mode's."""
    policy, _, mode = point
    return eq.engine_group(policy) + (MODES[mode][1] if mode in MODES else ())


def engine_kwargs(args, group: tuple = ()) -> dict:
    """eval_quality's engine options for `group`, with this script's chunk and context length
    (and no prefix caching: every point prefills its prompt itself)."""
    base = SimpleNamespace(block_size=args.block_size, query_cache_len=args.query_cache_len,
                           length=args.max_model_len - 64)
    return eq.engine_options(base, group) | dict(max_num_batched_tokens=args.chunk, max_model_len=args.max_model_len,
                                                 enable_prefix_caching=False)


def make_llm(loaded, args, group: tuple, max_num_seqs: int):
    """An engine over the loaded model whose pool holds `max_num_seqs` full-KV sequences at once."""
    from zipage_jax import LLM
    from zipage_jax.engine.llm_engine import LLMEngine

    per_seq = -(-args.max_model_len // args.block_size) + 2
    llm = LLM.__new__(LLM)  # one loaded model shared by every engine
    llm.engine = LLMEngine(loaded=loaded, num_kvcache_blocks=2 + max_num_seqs * per_seq, max_num_seqs=max_num_seqs,
                           **engine_kwargs(args, group))
    llm.tokenizer = llm.engine.tokenizer
    return llm


def sampling_params(job: eq.Job, point: Point, max_tokens: int | None = None):
    """eval_quality.run_jobs' greedy parameters for `job` at `point`."""
    from zipage_jax import SamplingParams

    policy, budget, mode = point
    return SamplingParams(temperature=0, max_tokens=max_tokens or len(job.forced) + job.free, ignore_eos=True,
                          logprobs=0, kv_budget=budget, eviction_policy=eq.VARIANTS[policy].get("eviction_policy"),
                          forced_token_ids=job.forced if max_tokens is None else None,
                          prompt_compression=MODES[mode][0] if mode in MODES else None)


def generate(llm, jobs: list[eq.Job], points: list[Point]) -> list[Outcome]:
    """Every job at once, keeping each request's metrics."""
    params = [sampling_params(job, point) for job, point in zip(jobs, points)]
    outs = llm.generate([job.prompt for job in jobs], params, use_tqdm=False)
    return [Outcome(eq.job_result(llm, job, out), dict(out["metrics"])) for job, out in zip(jobs, outs)]


def run_points(loaded, args, cases: list[Case], points: list[Point], log) -> tuple[dict, dict]:
    """{(point, case index): Outcome} and seconds per engine group. One engine per group of points
    sharing engine options; per case, the group's points run at once (their decodes batch)."""
    outcomes: dict[tuple[Point, int], Outcome] = {}
    timings: dict[str, float] = {}
    groups = [engine_group(p) for p in points]
    for group in dict.fromkeys(groups):
        mine = [p for p, g in zip(points, groups) if g == group]
        label = "+".join(dict.fromkeys(label_of(p) for p in mine))
        start = time.perf_counter()
        llm = make_llm(loaded, args, group, len(mine))
        for i, case in enumerate(cases):
            t = time.perf_counter()
            res = generate(llm, [case.job] * len(mine), mine)
            for point, out in zip(mine, res):
                outcomes[point, i] = out
            where = f"{case.length} depth {case.depth}" if case.depth is not None else case.length
            log(f"  {label} {case.task} {where} {case.name}: {time.perf_counter() - t:.0f}s; "
                + ", ".join(f"{label_of(p)}@{p[1]}: {describe(case, o)}" for p, o in zip(mine, res)))
        timings[label] = time.perf_counter() - start
        log(f"{label}: {timings[label]:.0f}s")
        del llm
        gc.collect()
    return outcomes, timings


def label_of(point: Point) -> str:
    return point[0] if point == FULL else f"{point[0]}/{point[2]}"


def prefill_timing(loaded, args, cases: list[Case], points: list[Point], log) -> list[dict]:
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


def passkey_found(job: eq.Job, result: eq.JobResult) -> bool:
    """Every key (two questions: both) appears in the generated text (eval_quality's passkey_correct
    asks one key to come first)."""
    return all(key in result.text for key in job.answer.split())


def blocks_bound(budget: int, args) -> int:
    """Blocks a sequence compressed between prefill chunks should never exceed: its budget, one
    chunk and the prompt tail's scratch blocks."""
    return sum(-(-n // args.block_size) for n in (budget, args.chunk, PROMPT_WINDOW))


def peak_fields(outs: list[Outcome], full: list[Outcome]) -> dict:
    peaks = [o.metrics.get("kv_blocks_peak", 0) for o in outs]
    return {
        "requests": len(outs),
        "kv_blocks_peak": max(peaks),
        "kv_blocks_peak_mean": sum(peaks) / len(peaks),
        "kv_blocks_peak_full": max(o.metrics.get("kv_blocks_peak", 0) for o in full),
        "num_compressions_mean": sum(o.metrics.get("num_compressions", 0) for o in outs) / len(outs),
        "num_compressions_max": max(o.metrics.get("num_compressions", 0) for o in outs),
    }


def passkey_row(outs: list[Outcome], full: list[Outcome], jobs: list[eq.Job]) -> dict:
    mine = [passkey_found(j, o.result) for j, o in zip(jobs, outs)]
    ref = [passkey_found(j, o.result) for j, o in zip(jobs, full)]
    both = sum(1 for a, b in zip(mine, ref) if a and b)
    keys = lambda outs: sum(key in o.result.text for j, o in zip(jobs, outs) for key in j.answer.split())
    return {
        "keys_found": keys(outs),  # two questions: each key counts
        "keys_found_full": keys(full),
        "keys": sum(len(j.answer.split()) for j in jobs),
        "accuracy": sum(mine) / len(mine),
        "correct": sum(mine),
        "full_correct": sum(ref),
        "both_correct": both,
        "relative_accuracy": both / sum(ref) if sum(ref) else None,
        "outputs": [o.result.text for o in outs],
        "answers": [j.answer for j in jobs],
    }


def continuation_row(policy: str, outs: list[Outcome], full: list[Outcome], jobs: list[eq.Job]) -> dict:
    """eval_quality.summarise's pooled perplexities (ppl_ratio = full / compressed)."""
    s = eq.summarise(policy, 1.0, jobs, [o.result for o in outs], [o.result for o in full])
    full_ppl = eq.summarise("full", 1.0, jobs, [o.result for o in full], [o.result for o in full])["ppl"]
    return {"ppl_ratio": s["ppl_ratio"], "ppl": s["ppl"], "ppl_full": full_ppl,
            "forced_tokens": sum(len(j.forced) for j in jobs), "docs": [j.workload[5:] for j in jobs]}


def make_rows(args, cases: list[Case], points: list[Point], outcomes: dict) -> list[dict]:
    """One row per (task, split, policy, budget, mode, length, depth), full KV's first."""
    keys: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        keys.setdefault((c.task, c.length, c.depth), []).append(i)
    rows = []
    for point in [FULL, *points]:
        policy, budget, mode = point
        for (task, length, depth), idx in keys.items():
            outs = [outcomes[point, i] for i in idx]
            full = [outcomes[FULL, i] for i in idx]
            jobs = [cases[i].job for i in idx]
            row = {"task": task, "split": args.split, "policy": policy, "budget_tokens": budget, "mode": mode,
                   "length": length, "depth": depth}
            row |= continuation_row(policy, outs, full, jobs) if task == "continuation" else passkey_row(outs, full, jobs)
            row |= peak_fields(outs, full)
            if budget and mode != "deferred":
                row["kv_blocks_bound"] = blocks_bound(budget, args)
            rows.append(row)
    return rows


# -- tables ------------------------------------------------------------------------------------


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(rows: list[dict], prefill: list[dict] = ()) -> str:
    """Passkey: accuracy per depth and over all depths, relative to full KV; two questions: both
    answered; continuation: ppl_ratio; all with the peak KV blocks (compressed's max vs full KV's);
    prefill: median seconds and the ratio to full KV's."""
    out = []
    passkey = [r for r in rows if r["task"] == "passkey"]
    if passkey:
        depths = sorted({r["depth"] for r in passkey})
        out.append("| split | policy | mode | budget | length | " + " | ".join(f"@{d:g}" for d in depths)
                   + " | all | rel. to full | peak blocks (full) | compressions |\n"
                   + "|---" * (9 + len(depths)) + "|\n")
        for key, rs in _grouped(passkey).items():
            by_depth: dict = {}
            for r in rs:
                by_depth.setdefault(r["depth"], []).append(r)
            accs = " | ".join(f"{sum(r['correct'] for r in by_depth[d])}/{sum(r['requests'] for r in by_depth[d])}"
                              if d in by_depth else "-" for d in depths)
            out.append(_summary_line(key, rs, accs))
    two = [r for r in rows if r["task"] == "two-question"]
    if two:
        out.append("\n| split | policy | mode | budget | length | keys found (full) | both keys | rel. to full "
                   "| peak blocks (full) | compressions |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for key, rs in _grouped(two).items():
            found = (f"{sum(r['keys_found'] for r in rs)}/{sum(r['keys'] for r in rs)} "
                     f"({sum(r['keys_found_full'] for r in rs)})")
            out.append(_summary_line(key, rs, found))
    cont = [r for r in rows if r["task"] == "continuation"]
    if cont:
        out.append("\n| split | policy | mode | budget | prompt | ppl_ratio | ppl (full) | peak blocks (full) "
                   "| compressions |\n|---|---|---|---|---|---|---|---|---|\n")
        for r in cont:
            out.append(f"| {r['split']} | {r['policy']} | {r['mode']} | {r['budget_tokens'] or 'full'} | {r['length']} "
                       f"| {_f(r['ppl_ratio'], 4)} | {_f(r['ppl'], 2)} ({_f(r['ppl_full'], 2)}) | {r['kv_blocks_peak']} "
                       f"({r['kv_blocks_peak_full']}) | {r['num_compressions_mean']:.1f} |\n")
    if prefill:
        out.append("\n| split | policy | mode | budget | prompt | prefill s (median) | x full KV | peak blocks |\n"
                   "|---|---|---|---|---|---|---|---|\n")
        for r in prefill:
            out.append(f"| {r['split']} | {r['policy']} | {r['mode']} | {r['budget_tokens'] or 'full'} | {r['length']} "
                       f"| {r['median_seconds']:.2f} | {r['ratio_to_full']:.3f} | {r['kv_blocks_peak']} |\n")
    return "".join(out).lstrip("\n")


def _grouped(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["split"], r["policy"], r["mode"], r["budget_tokens"], r["length"]), []).append(r)
    return groups


def _summary_line(key: tuple, rs: list[dict], middle: str | None = None) -> str:
    split, policy, mode, budget, length = key
    n = sum(r["requests"] for r in rs)
    correct = sum(r["correct"] for r in rs)
    full_ok = sum(r["full_correct"] for r in rs)
    both = sum(r["both_correct"] for r in rs)
    comp = sum(r["num_compressions_mean"] * r["requests"] for r in rs) / n
    cells = [split, policy, mode, budget or "full", length, *([middle] if middle else []), f"{correct}/{n}",
             f"{both}/{full_ok}" if full_ok else "-",
             f"{max(r['kv_blocks_peak'] for r in rs)} ({max(r['kv_blocks_peak_full'] for r in rs)})", f"{comp:.1f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |\n"


# -- main --------------------------------------------------------------------------------------


def evaluate(args) -> tuple[list[dict], dict, dict]:
    from zipage_jax.models.loading import load_model

    log = functools.partial(print, file=sys.stderr, flush=True)
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
    outcomes, timings = run_points(loaded, args, cases, [FULL], log)
    more, more_timings = run_points(loaded, args, cases, points, log)
    outcomes |= more
    timings |= more_timings
    start_timing = time.perf_counter()
    prefill = prefill_timing(loaded, args, cases, points, log)
    timings["prefill_timing"] = time.perf_counter() - start_timing
    timings["total"] = time.perf_counter() - start
    rows = make_rows(args, cases, points, outcomes)
    workloads = {"split": args.split, "block_size": args.block_size, "chunk": args.chunk,
                 "query_cache_len": args.query_cache_len, "max_model_len": args.max_model_len,
                 "model": loaded.source,
                 "cases": [{"task": c.task, "length": c.length, "depth": c.depth, "actual_depth": c.actual_depth,
                            "name": c.name, "workload": c.job.workload, "prompt_tokens": len(c.job.prompt),
                            "forced_tokens": len(c.job.forced), "free_tokens": c.job.free} for c in cases]}
    return rows, prefill, workloads, timings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--split", choices=("dev", "heldout"), default="heldout")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="about 10 min on 2 CPU cores: length 4000, 3 depths, no second question, one 3000-token "
                           "text, 128 forced, bounded and deferred, no timing")
    mode.add_argument("--smoke", action="store_true", help="a few tiny cases (for a tiny test model)")
    p.add_argument("--json", action="store_true",
                   help="last line: {\"results\": [...], \"workloads\": ..., \"timings\": ..., \"run\": ...}")
    p.add_argument("--policies", nargs="+", default=None, choices=[v for v in eq.VARIANTS if v != "full"],
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
    args = p.parse_args(argv)
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
                    depths=list(DEPTHS[args.split]), trials=1, two_question_lengths=[4000],
                    doc_lengths=list(DOC_LENGTHS), num_docs=1, forced_tokens=256, block_size=32,
                    query_cache_len=16, chunk=512, timing_reps=3) | defaults
    args.two_question_depths = TWO_QUESTION_DEPTHS[args.split]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if any(b < max(args.block_size, args.query_cache_len + 4) for b in args.budgets):
        p.error(f"budgets must hold at least a block ({args.block_size}) and the query cache + 4 tokens")
    if not all(0 <= d <= 1 for d in args.depths):
        p.error("depths are fractions in [0, 1]")
    if args.trials < 0 or args.num_docs < 0 or args.forced_tokens < 1 or args.timing_reps < 0:
        p.error("--trials, --num-docs and --timing-reps must be >= 0 and --forced-tokens >= 1")
    if not (args.trials and args.lengths and args.depths) and not (args.num_docs and args.doc_lengths):
        p.error("nothing to run")
    return args


def main(argv: list[str] | None = None) -> tuple[list[dict], dict]:
    args = parse_args(argv)
    rows, prefill, workloads, timings = evaluate(args)
    tables = markdown_tables(rows, prefill)
    print(tables)
    if args.markdown:
        Path(args.markdown).write_text(tables)
    if args.json:
        from zipage_jax.run_info import run_info

        print(json.dumps({"results": rows, "prefill": prefill, "workloads": workloads, "timings": timings,
                          "run": run_info()}))
    return rows, workloads


if __name__ == "__main__":
    main()
