"""Quality of compressed KV vs full KV when the PROMPT is long (compression during chunked prefill).

    python scripts/eval_long_prompt.py [--split dev|heldout] [--quick | --smoke] [--json]
                                       [--policies vnorm-prompt zipage streaming] [--budgets 256 512]
                                       [--lengths 4000 8000] [--depths 0.1 0.5 0.9] [--trials 2]
                                       [--doc-lengths 6000] [--forced-tokens 256] [--chunk 512]

Every case is prefilled as a prompt in chunks of --chunk tokens (max_num_batched_tokens), once with
full KV and once per policy at every budget (`SamplingParams(kv_budget=tokens)`, 0 = full KV):
  (a) passkey: a random 5-digit key stated at a depth (a fraction of the prompt) inside a filler of
      --lengths tokens, the question at the end, then a few greedy tokens; correct = the key appears
      in them. relative_accuracy = of the cases full KV answers right, the share compressed also does.
  (b) continuation: the first --doc-lengths tokens of a long text as the prompt, the next
      --forced-tokens of it forced (`forced_token_ids`, logprobs=0); ppl_ratio = full-KV perplexity /
      compressed perplexity over the forced tokens (1.0 = no loss), as scripts/eval_quality.py.
Every row also gives each request's `kv_blocks_peak` and `num_compressions` (the engine's metrics)
and full KV's peak for the same cases, so the bound on KV memory during prefill shows.

The data come from eval_quality's two splits: "dev" (tuned on): its passkey filler, seed 0, and
its dev texts (argparse.py, pydoc_data/topics.py); "heldout" (never tuned on): a filler of the
first held-out text of kind "license" (digits removed), another seed, and the first held-out texts
by eval_quality's fixed rule (`heldout_sources`). Policies, their engine options and the engine
options' base are eval_quality's (VARIANTS, engine_group, engine_options): policies that share
engine options share one engine, full KV has its own.
The last line with --json is {"results": [...], "workloads": {...}, "timings": {...}, "run": {...}}.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # eval_quality, run_info: beside this script


import eval_quality as eq  # noqa: E402

DEFAULT_POLICIES = ["vnorm-prompt", "zipage", "streaming"]  # the engine's default first
BUDGETS = (256, 512)  # kv_budget tokens
LENGTHS = (4000, 8000)  # passkey prompt tokens
DEPTHS = (0.1, 0.5, 0.9)  # where the key is stated, as a fraction of the prompt
DOC_LENGTHS = (6000,)  # continuation prompt tokens
SEEDS = {"dev": 0, "heldout": 1}  # passkey keys
INTRO = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there. ")  # eval_quality's passkey wording
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
SENTENCE_END = re.compile(r"[.!?\n]")


@dataclass
class Case:
    """One prompt of one task: `job` (eval_quality's Job) runs once per point."""

    task: str  # "passkey" or "continuation"
    split: str
    length: int  # prompt tokens
    depth: float | None  # passkey: asked for; None for continuation
    name: str  # passkey: "trial<k>"; continuation: the text's name
    job: eq.Job
    actual_depth: float | None = None  # passkey: where the key's sentence starts, of the prompt


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
    intro = tokenizer(INTRO)["input_ids"]
    needle = tokenizer(NEEDLE.format(key=key))["input_ids"]
    question = tokenizer(QUESTION)["input_ids"]
    room = length - len(intro) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a passkey prompt of {length} tokens has no room for filler")
    hay = (filler * (room // len(filler) + 1))[:room]
    target = min(room, max(0, round(depth * length) - len(intro)))  # depth: of the prompt
    ends = sentence_ends(tokenizer, filler) if ends is None else ends
    cut = next((i + 1 for i in range(target - 1, max(-1, target - 257), -1) if ends[i % len(filler)]), target)
    ids = intro + hay[:cut] + needle + hay[cut:] + question
    return ids, (len(intro) + cut) / length


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
            + continuation_cases(tokenizer, args.split, args.doc_lengths, args.forced_tokens, args.num_docs))


# -- running -----------------------------------------------------------------------------------


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


def generate(llm, jobs: list[eq.Job], budgets: list[int], policies: list[str]) -> list[Outcome]:
    """Every job at once (eval_quality.run_jobs), keeping each request's metrics."""
    outs = eq.run_jobs(llm, jobs, budgets, policies)
    return [Outcome(eq.job_result(llm, job, out), dict(out["metrics"])) for job, out in zip(jobs, outs)]


def run_points(loaded, args, cases: list[Case], points: list[tuple[str, int]], log) -> tuple[dict, dict]:
    """{(point, case index): Outcome} and seconds per engine group. One engine per group of policies
    sharing engine options; per case, the group's points run at once (their decodes batch)."""
    outcomes: dict[tuple[tuple[str, int], int], Outcome] = {}
    timings: dict[str, float] = {}
    groups = [eq.engine_group(policy) for policy, _ in points]
    for group in dict.fromkeys(groups):
        mine = [p for p, g in zip(points, groups) if g == group]
        label = "+".join(dict.fromkeys(p for p, _ in mine))
        start = time.perf_counter()
        llm = make_llm(loaded, args, group, len(mine))
        for i, case in enumerate(cases):
            t = time.perf_counter()
            res = generate(llm, [case.job] * len(mine), [b for _, b in mine], [p for p, _ in mine])
            for point, out in zip(mine, res):
                outcomes[point, i] = out
            where = f"{case.length} depth {case.depth}" if case.task == "passkey" else case.length
            log(f"  {label} {case.task} {where} {case.name}: {time.perf_counter() - t:.0f}s; "
                + ", ".join(f"{p}@{b}: {describe(case, o)}" for (p, b), o in zip(mine, res)))
        timings[label] = time.perf_counter() - start
        log(f"{label}: {timings[label]:.0f}s")
        del llm
        gc.collect()
    return outcomes, timings


def describe(case: Case, out: Outcome) -> str:
    m = out.metrics
    what = (f"{'ok' if passkey_found(case.job, out.result) else 'MISS'} {out.result.text.strip()[:16]!r}"
            if case.task == "passkey" else f"nll {-out.result.logprobs.sum():.1f}")
    return f"{what} peak {m.get('kv_blocks_peak')} comp {m.get('num_compressions')}"


# -- scoring -----------------------------------------------------------------------------------


def passkey_found(job: eq.Job, result: eq.JobResult) -> bool:
    """The key appears in the generated text (eval_quality's passkey_correct asks it to come first)."""
    return job.answer in result.text


def blocks_bound(budget: int, args) -> int:
    """Blocks a sequence compressed during prefill should never exceed: its budget, one chunk, and
    one block of slack (a chunk that does not start on a block boundary)."""
    return -(-budget // args.block_size) + -(-args.chunk // args.block_size) + 1


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
    return {
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


def make_rows(args, cases: list[Case], points: list[tuple[str, int]], outcomes: dict) -> list[dict]:
    """One row per (task, split, policy, budget, length, depth), full KV's first."""
    keys: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        keys.setdefault((c.task, c.length, c.depth), []).append(i)
    rows = []
    for policy, budget in [("full", 0), *points]:
        for (task, length, depth), idx in keys.items():
            outs = [outcomes[(policy, budget), i] for i in idx]
            full = [outcomes[("full", 0), i] for i in idx]
            jobs = [cases[i].job for i in idx]
            row = {"task": task, "split": args.split, "policy": policy, "budget_tokens": budget, "length": length,
                   "depth": depth}
            row |= passkey_row(outs, full, jobs) if task == "passkey" else continuation_row(policy, outs, full, jobs)
            row |= peak_fields(outs, full)
            if budget:
                row["kv_blocks_bound"] = blocks_bound(budget, args)
            rows.append(row)
    return rows


# -- tables ------------------------------------------------------------------------------------


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_tables(rows: list[dict]) -> str:
    """Passkey: accuracy per depth and over all depths, relative to full KV; continuation:
    ppl_ratio; both with the peak KV blocks (compressed's max vs full KV's)."""
    out = []
    passkey = [r for r in rows if r["task"] == "passkey"]
    if passkey:
        depths = sorted({r["depth"] for r in passkey})
        out.append("| split | policy | budget | length | " + " | ".join(f"acc @{d:g}" for d in depths)
                   + " | acc all | rel. to full | peak blocks (full) | compressions |\n"
                   + "|---" * (8 + len(depths)) + "|\n")
        groups: dict[tuple, list[dict]] = {}
        for r in passkey:
            groups.setdefault((r["split"], r["policy"], r["budget_tokens"], r["length"]), []).append(r)
        for (split, policy, budget, length), rs in groups.items():
            by_depth = {r["depth"]: r for r in rs}
            n = sum(r["requests"] for r in rs)
            correct = sum(r["correct"] for r in rs)
            full_ok = sum(r["full_correct"] for r in rs)
            both = sum(r["both_correct"] for r in rs)
            accs = " | ".join(_f(by_depth[d]["accuracy"], 2) if d in by_depth else "-" for d in depths)
            comp = sum(r["num_compressions_mean"] * r["requests"] for r in rs) / n
            out.append(f"| {split} | {policy} | {budget or 'full'} | {length} | {accs} | {correct}/{n} "
                       f"| {f'{both}/{full_ok}' if full_ok else '-'} | {max(r['kv_blocks_peak'] for r in rs)} "
                       f"({max(r['kv_blocks_peak_full'] for r in rs)}) | {comp:.1f} |\n")
    cont = [r for r in rows if r["task"] == "continuation"]
    if cont:
        if out:
            out.append("\n")
        out.append("| split | policy | budget | prompt | ppl_ratio | ppl (full) | peak blocks (full) | compressions |\n"
                   "|---|---|---|---|---|---|---|---|\n")
        for r in cont:
            out.append(f"| {r['split']} | {r['policy']} | {r['budget_tokens'] or 'full'} | {r['length']} | "
                       f"{_f(r['ppl_ratio'], 4)} | {_f(r['ppl'], 2)} ({_f(r['ppl_full'], 2)}) | {r['kv_blocks_peak']} "
                       f"({r['kv_blocks_peak_full']}) | {r['num_compressions_mean']:.1f} |\n")
    return "".join(out)


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
    points = [(p, b) for b in args.budgets for p in args.policies]
    log(f"{args.split}: {len(cases)} cases, {len(points)} compressed points, chunk {args.chunk}, "
        f"block {args.block_size}, max_model_len {args.max_model_len}")
    outcomes, timings = run_points(loaded, args, cases, [("full", 0)], log)
    more, more_timings = run_points(loaded, args, cases, points, log)
    outcomes |= more
    timings |= more_timings
    timings["total"] = time.perf_counter() - start
    rows = make_rows(args, cases, points, outcomes)
    workloads = {"split": args.split, "block_size": args.block_size, "chunk": args.chunk,
                 "query_cache_len": args.query_cache_len, "max_model_len": args.max_model_len,
                 "model": loaded.source,
                 "cases": [{"task": c.task, "length": c.length, "depth": c.depth, "actual_depth": c.actual_depth,
                            "name": c.name, "workload": c.job.workload, "prompt_tokens": len(c.job.prompt),
                            "forced_tokens": len(c.job.forced), "free_tokens": c.job.free} for c in cases]}
    return rows, workloads, timings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--split", choices=("dev", "heldout"), default="heldout")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="< 10 min on 2 CPU cores: length 4000, 1 trial, budget 512, one 3000-token text, 128 forced")
    mode.add_argument("--smoke", action="store_true", help="a few tiny cases (for a tiny test model)")
    p.add_argument("--json", action="store_true",
                   help="last line: {\"results\": [...], \"workloads\": ..., \"timings\": ..., \"run\": ...}")
    p.add_argument("--policies", nargs="+", default=None, choices=[v for v in eq.VARIANTS if v != "full"],
                   help=f"default {' '.join(DEFAULT_POLICIES)}")
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="kv_budget tokens (default 256 512)")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="passkey prompt tokens (default 4000 8000)")
    p.add_argument("--depths", nargs="+", type=float, default=None, help="passkey depths (default 0.1 0.5 0.9)")
    p.add_argument("--trials", type=int, default=None, help="passkeys per (length, depth) (default 2)")
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
        defaults = dict(policies=["streaming"], budgets=[64], lengths=[320], depths=[0.5], trials=1,
                        doc_lengths=[128], num_docs=1, forced_tokens=16, block_size=16, query_cache_len=4, chunk=64)
    elif args.quick:
        defaults = dict(budgets=[512], lengths=[4000], trials=1, doc_lengths=[3000], num_docs=1, forced_tokens=128)
    else:
        defaults = {}
    defaults = dict(policies=DEFAULT_POLICIES, budgets=list(BUDGETS), lengths=list(LENGTHS), depths=list(DEPTHS),
                    trials=2, doc_lengths=list(DOC_LENGTHS), num_docs=2, forced_tokens=256, block_size=32,
                    query_cache_len=16, chunk=512) | defaults
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if any(b < max(args.block_size, args.query_cache_len + 4) for b in args.budgets):
        p.error(f"budgets must hold at least a block ({args.block_size}) and the query cache + 4 tokens")
    if not all(0 <= d <= 1 for d in args.depths):
        p.error("depths are fractions in [0, 1]")
    if args.trials < 0 or args.num_docs < 0 or args.forced_tokens < 1:
        p.error("--trials and --num-docs must be >= 0 and --forced-tokens >= 1")
    if not (args.trials and args.lengths and args.depths) and not (args.num_docs and args.doc_lengths):
        p.error("nothing to run")
    return args


def main(argv: list[str] | None = None) -> tuple[list[dict], dict]:
    args = parse_args(argv)
    rows, workloads, timings = evaluate(args)
    tables = markdown_tables(rows)
    print(tables)
    if args.markdown:
        Path(args.markdown).write_text(tables)
    if args.json:
        from zipage_jax.run_info import run_info

        print(json.dumps({"results": rows, "workloads": workloads, "timings": timings, "run": run_info()}))
    return rows, workloads


if __name__ == "__main__":
    main()
