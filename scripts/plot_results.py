"""Quality vs KV budget per policy, from the JSON line of scripts/eval_quality.py --json.

    python scripts/eval_quality.py --json | tail -1 > quality.json
    python scripts/plot_results.py quality.json [more.json ...] [--out docs/quality_vs_budget.png]

Several files are merged (a later file's row replaces an earlier one for the same policy and budget).

One panel per metric present (text and reasoning ppl_ratio, passkey accuracy, greedy
agreement); x: budget as a fraction of the context (log scale), one line per policy, full KV
as a dashed reference at 1.0 (or its passkey accuracy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = {
    "ppl_ratio": "ppl ratio, text (full / compressed)",
    "reasoning_ppl_ratio": "ppl ratio, reasoning",
    "passkey_accuracy": "passkey accuracy",
    "agreement": "greedy agreement with full KV",
}


def load_rows(path: Path) -> list[dict]:
    """The results of a file holding the {"results": [...]} object (alone or as its last line)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty")
    data = json.loads(lines[-1])
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: the last line is not a {{\"results\": [...]}} object")
    return data["results"]


def merge(files: list[Path]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for path in files:
        for row in load_rows(path):
            rows[(row["policy"], row["budget_fraction"])] = row
    return list(rows.values())


def plot(rows: list[dict], out: Path) -> list[str]:
    """Writes the PNG; returns the metrics plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next((r for r in rows if r["policy"] == "full"), None)
    compressed = [r for r in rows if r["policy"] != "full"]
    if not compressed:
        raise ValueError("no compressed policy in the results")
    metrics = [m for m in METRICS if any(r.get(m) is not None for r in compressed)]
    policies = list(dict.fromkeys(r["policy"] for r in compressed))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for policy in policies:
            points = sorted((r["budget_fraction"], r[metric]) for r in compressed
                            if r["policy"] == policy and r.get(metric) is not None)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=policy)
        if full is not None and full.get(metric) is not None:
            ax.axhline(full[metric], color="black", linestyle="--", linewidth=1, label="full KV")
        ax.set_xscale("log", base=2)
        fractions = sorted({r["budget_fraction"] for r in compressed})
        ax.set_xticks(fractions, [f"1/{round(1 / f)}" if f < 1 else "1" for f in fractions])
        ax.set_xlabel("KV budget (fraction of the context)")
        ax.set_title(METRICS[metric], fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return metrics


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="quality vs budget plot from eval_quality.py --json")
    p.add_argument("results", type=Path, nargs="+", help="files whose last line is eval_quality.py's JSON")
    p.add_argument("--out", type=Path, default=Path("docs/quality_vs_budget.png"))
    args = p.parse_args(argv)
    metrics = plot(merge(args.results), args.out)
    print(f"wrote {args.out} ({', '.join(metrics)})")


if __name__ == "__main__":
    main()
