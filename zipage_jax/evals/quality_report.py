"""eval quality's rows and tables: one row per (policy, kv dtype, fraction kind, fraction, split);
the markdown has one table per fraction kind, held-out cells with dev in parentheses."""

from __future__ import annotations

from zipage_jax.compress.auto_budget import Budget
from zipage_jax.evals.forcing import WORKLOADS, Job, JobResult, workload_of
from zipage_jax.evals.quality_budgets import Point, budget_fields
from zipage_jax.evals.scoring import summarise

TABLE_TITLES = {"tokens": "Token budgets: a fraction of each workload's context (kv dtype auto)",
                "auto": "Automatic budgets (kv_budget=\"auto\"): kept tokens are each workload's mean peak KV, "
                        "of its mean context",
                "memory": "Equal memory: a fraction of the bf16 full KV's bytes"}


def point_rows(point: Point, jobs: list[Job], results: list[JobResult], full: list[JobResult], budgets: list[Budget],
               loaded) -> list[dict]:
    """One row per split of the jobs. by_workload: per workload its (longest job's) context and budget
    as tokens and as memory (budget_fields); an automatic budget's are its jobs' mean context and mean
    peak KV (measured). The row's flat fields are its first workload's."""
    rows = []
    for split in dict.fromkeys(j.split for j in jobs):
        idx = [i for i, j in enumerate(jobs) if j.split == split]
        row = summarise(point.policy, point.fraction, [jobs[i] for i in idx], [results[i] for i in idx],
                        [full[i] for i in idx])
        by_workload = {}
        for workload in WORKLOADS:
            mine = [i for i in idx if workload_of(jobs[i]) == workload]
            if mine:
                by_workload[workload] = budget_fields(loaded.config, point, *_kept(point, mine, jobs, results, budgets),
                                                      loaded.model.dtype)
        first = next(iter(by_workload.values()))
        row |= {"split": split, "kv_cache_dtype": point.kv_cache_dtype, "fraction_kind": point.fraction_kind,
                "fraction": point.fraction, **first, "by_workload": by_workload}
        if point.fraction_kind != "tokens":
            row["budget_fraction"] = first["kept_fraction"]
        if point.fraction_kind == "memory":
            row["memory_fraction"] = point.fraction if point.policy != "full" else first["memory_fraction_bf16"]
        rows.append(row)
    return rows


def _kept(point: Point, mine: list[int], jobs: list[Job], results: list[JobResult],
          budgets: list[Budget]) -> tuple[int, int]:
    """(context, budget tokens) that a workload's jobs `mine` stand for at `point` (0 tokens: all)."""
    if point.fraction_kind == "auto":
        context = round(sum(jobs[i].context for i in mine) / len(mine))
        return context, 0 if point.policy == "full" else round(sum(results[i].peak_kv_tokens for i in mine) / len(mine))
    i = max(mine, key=lambda i: jobs[i].context)
    return jobs[i].context, budgets[i]


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _f4(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _point(kind: str, policy: str, fraction: float, fmt: str) -> str:
    """A budget as shown: its fraction, or "auto"."""
    return "auto" if kind == "auto" and policy != "full" else format(fraction, fmt)


def row_kind(row: dict) -> str:
    """A row's fraction kind (rows of older runs: by their fields)."""
    return row.get("fraction_kind") or ("memory" if "memory_fraction" in row else "tokens")


def format_row(row: dict) -> str:
    """A row as one progress line."""
    kept = " ".join(f"{w} {f['budget_tokens']}/{f['context']}" for w, f in row.get("by_workload", {}).items())
    return (f"{row['policy']:>14} {row.get('kv_cache_dtype', 'auto'):>4} {row_kind(row):>6} "
            f"{_point(row_kind(row), row['policy'], row.get('fraction', row['budget_fraction']), '.4f')} "
            f"{row.get('split', 'dev'):>7} ({kept}) "
            f"ppl_ratio {_f(row['ppl_ratio'])} reasoning {_f(row['reasoning_ppl_ratio'])} "
            f"passkey {_f(row['passkey_accuracy'])} agreement {_f(row['agreement'])}")


def markdown_table(rows: list[dict], lengths: dict[str, int] | None = None) -> str:
    """One table per fraction kind (tokens, memory), one line per (policy, kv dtype, fraction): held-out
    numbers with dev in parentheses (where both splits ran), after the context lengths."""
    parts = []
    if lengths:
        parts.append("Context: " + ", ".join(f"{w} {n} tokens" for w, n in lengths.items()) + ".\n")
    for kind in dict.fromkeys(row_kind(r) for r in rows):
        mine = [r for r in rows if row_kind(r) == kind]
        parts.append(f"{TABLE_TITLES[kind]}\n\n{fraction_table(mine, kind)}")
    return "\n".join(parts)


def fraction_table(rows: list[dict], kind: str) -> str:
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["policy"], r.get("kv_cache_dtype", "auto"), r.get("fraction", r["budget_fraction"]))
        points.setdefault(key, {})[r.get("split", "dev")] = r

    def pair(splits: dict, key: str) -> str:
        held, dev = splits.get("heldout", {}).get(key), splits.get("dev", {}).get(key)
        if "heldout" in splits and "dev" in splits:
            return f"{_f(held)} ({_f(dev)})"
        return _f(held if dev is None else dev)

    def per_workload(r: dict, field: str, fmt: str) -> str:
        values = [format(f[field], fmt) for w, f in r.get("by_workload", {}).items() if w in shown]
        return " / ".join(dict.fromkeys(values)) if field != "budget_tokens" else " / ".join(values)

    present = [w for r in rows for w in r.get("by_workload", {})]
    shown = [w for w in WORKLOADS if w in present and w != "passkey"] or [w for w in WORKLOADS if w in present]
    metrics = [("ppl_ratio", "ppl_ratio text"), ("reasoning_ppl_ratio", "ppl_ratio reasoning"),
               ("passkey_accuracy", "passkey"), ("agreement", "agreement")]
    metrics = [(k, name) for k, name in metrics if any(r.get(k) is not None for r in rows)] or metrics[:2]
    order = f" ({' / '.join(shown)})" if len(shown) > 1 else ""
    kept, bf16 = f"kept tokens{order}", f"memory of bf16 full KV{order}"
    head = (["policy", "kv dtype", bf16, f"of f32{order}", kept] if kind == "memory"
            else ["policy", "budget (of tokens)", kept, bf16]) + [name for _, name in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (policy, dtype, fraction), splits in points.items():
        r = next(iter(splits.values()))
        if "by_workload" in r:
            bf16, f32 = per_workload(r, "memory_fraction_bf16", ".4f"), per_workload(r, "memory_fraction_f32", ".4f")
            tokens = per_workload(r, "budget_tokens", "d")
        else:  # a row of an older run
            bf16, f32 = _f4(r.get("memory_fraction_bf16")), _f4(r.get("memory_fraction_f32"))
            tokens = str(r.get("budget_tokens", "-"))
        budget = _point(kind, policy, fraction, ".4g")
        cells = ([policy, dtype, bf16, f32, tokens] if kind == "memory"
                 else [policy, budget, tokens, bf16]) + [pair(splits, k) for k, _ in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
