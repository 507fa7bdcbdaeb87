"""eval long-prompt's rows and tables: pass keys found relative to full KV, continuation
perplexity ratios, and each request's peak KV blocks and compactions."""

from __future__ import annotations

import argparse

from zipage_jax.evals.forcing import Job, JobResult
from zipage_jax.evals.long_prompt_cases import FULL, Case, Outcome, Point
from zipage_jax.evals.scoring import summarise

PROMPT_WINDOW = 32  # the engine's default prompt_window: the tail's tokens


def passkey_found(job: Job, result: JobResult) -> bool:
    """Every key (two questions: both) appears in the generated text (scoring.passkey_correct
    asks one key to come first)."""
    return all(key in result.text for key in job.answer.split())


def blocks_bound(budget: int, args: argparse.Namespace) -> int:
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


def passkey_row(outs: list[Outcome], full: list[Outcome], jobs: list[Job]) -> dict:
    mine = [passkey_found(j, o.result) for j, o in zip(jobs, outs, strict=True)]
    ref = [passkey_found(j, o.result) for j, o in zip(jobs, full, strict=True)]
    both = sum(1 for a, b in zip(mine, ref, strict=True) if a and b)

    def keys(outs: list[Outcome]) -> int:
        return sum(key in o.result.text for j, o in zip(jobs, outs, strict=True) for key in j.answer.split())

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


def continuation_row(policy: str, outs: list[Outcome], full: list[Outcome], jobs: list[Job]) -> dict:
    """scoring.summarise's pooled perplexities (ppl_ratio = full / compressed)."""
    s = summarise(policy, 1.0, jobs, [o.result for o in outs], [o.result for o in full])
    full_ppl = summarise("full", 1.0, jobs, [o.result for o in full], [o.result for o in full])["ppl"]
    return {"ppl_ratio": s["ppl_ratio"], "ppl": s["ppl"], "ppl_full": full_ppl,
            "forced_tokens": sum(len(j.forced) for j in jobs), "docs": [j.workload[5:] for j in jobs]}


def make_rows(args: argparse.Namespace, cases: list[Case], points: list[Point], outcomes: dict) -> list[dict]:
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
            row |= (continuation_row(policy, outs, full, jobs) if task == "continuation"
                    else passkey_row(outs, full, jobs))
            row |= peak_fields(outs, full)
            if budget and mode != "deferred":
                row["kv_blocks_bound"] = blocks_bound(budget, args)
            rows.append(row)
    return rows


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
                       f"| {_f(r['ppl_ratio'], 4)} | {_f(r['ppl'], 2)} ({_f(r['ppl_full'], 2)}) "
                       f"| {r['kv_blocks_peak']} ({r['kv_blocks_peak_full']}) | {r['num_compressions_mean']:.1f} |\n")
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
