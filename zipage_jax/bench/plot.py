"""Quality vs KV budget per policy, from the JSON line of `zipage-jax eval quality --json`;
throughput and concurrency vs budget, from `zipage-jax bench throughput`'s sweep; step time and
tokens/s against generated tokens, from `zipage-jax bench long`.

    zipage-jax eval quality --json | tail -1 > quality.json
    zipage-jax bench plot quality.json [more.json ...] [--out docs/quality_vs_budget.png]

    zipage-jax bench throughput --quick --json --budgets 2 4 8 --policies zipage window | tail -1 > sweep.json
    zipage-jax bench plot sweep.json [--out docs/throughput_vs_budget.png]

    zipage-jax bench long --quick --json | tail -1 > long.json
    zipage-jax bench plot long.json [--out docs/long_generation.png]

The JSON results kept with the figures are in docs/results/; the figures are written to docs/.

A file whose last line holds `bench long`'s object ("compressed" and "full" runs) gets two
panels, step time and tokens/s per window against the generated tokens of each request (the
window's middle), one line per run, the first window after the budget fills marked.

A file whose last line holds a {"sweep": [...]} object gets the throughput plot: two panels,
output tok/s and mean running sequences vs the budget in blocks (log scale), one line per
policy, full KV as a dashed reference line.

Several files are merged (a later file's row replaces an earlier one for the same policy, fraction
kind, budget, dtype, memory fraction and split).

Equal-memory rows (`eval quality --memory-fractions`) get their own plot: a row of panels per split
(held-out first), text and reasoning ppl_ratio against the memory as a fraction of the bfloat16 full
KV (log scale), one line per policy x kv dtype (colour: policy, line style: dtype), quantization
alone (a quantized dtype with full KV) as single points, full KV and the 0.97 goal as reference lines.

Token-budget rows (--budgets): one panel per metric present (text and reasoning ppl_ratio, passkey
accuracy, greedy agreement); x: budget as a fraction of the context (log scale), one line per policy
(and split: held-out solid, dev dashed with hollow markers), full KV as a dashed reference at 1.0 (or its passkey
accuracy). A run with both kinds gets both plots: the memory plot at --out (default
docs/quality_vs_memory.png), the token plot beside it ("_tokens" added to --out's name; default
docs/quality_vs_budget.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zipage_jax.harness import usage_error

METRICS = {
    "ppl_ratio": "ppl ratio, text (full / compressed)",
    "reasoning_ppl_ratio": "ppl ratio, reasoning",
    "passkey_accuracy": "passkey accuracy",
    "agreement": "greedy agreement with full KV",
}


def save_figure(fig, out: Path, tight: bool = False) -> None:
    """Write `fig` to `out` (its folder created) and free it."""
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, **({"bbox_inches": "tight"} if tight else {}))
    plt.close(fig)


def load_json(path: Path) -> dict:
    """The JSON object on a file's last non-empty line."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty")
    data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the last line is not a JSON object")
    return data


def load_rows(path: Path) -> list[dict]:
    """The results of a file holding the {"results": [...]} object (alone or as its last line)."""
    data = load_json(path)
    if not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: the last line is not a {{\"results\": [...]}} object")
    return data["results"]


def merge(files: list[Path]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for path in files:
        for row in load_rows(path):
            key = (row["policy"], row.get("fraction_kind"), row["budget_fraction"], row.get("kv_cache_dtype"),
                   row.get("memory_fraction"), row.get("split"))
            rows[key] = row
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
    splits = sorted({r.get("split", "dev") for r in compressed}, key=lambda s: (s != "heldout", s))
    colours = {p: f"C{i}" for i, p in enumerate(policies)}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for policy in policies:
            for split in splits:
                points = sorted((r["budget_fraction"], r[metric]) for r in compressed if r["policy"] == policy
                                and r.get("split", "dev") == split and r.get(metric) is not None)
                if points:
                    xs, ys = zip(*points, strict=True)
                    dev = split == "dev" and len(splits) > 1  # dashed, hollow markers
                    ax.plot(xs, ys, marker="o", color=colours[policy], linestyle="--" if dev else "-",
                            fillstyle="none" if dev else "full",
                            label=policy if len(splits) == 1 else f"{policy} ({split})")
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
    save_figure(fig, out)
    return metrics


MEMORY_METRICS = {"ppl_ratio": "text", "reasoning_ppl_ratio": "reasoning"}
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))  # kv dtypes in order of appearance
MARKERS = ("s", "D", "^", "v", "P", "X")  # quantization alone, per kv dtype
GOAL = 0.97


def row_kind(row: dict) -> str:
    """"memory" (--memory-fractions) or "tokens" (--budgets); rows of older runs by their fields."""
    return row.get("fraction_kind") or ("memory" if "memory_fraction" in row else "tokens")


def is_memory(rows: list[dict]) -> bool:
    return any(row_kind(r) == "memory" for r in rows)


def memory_x(row: dict, metric: str) -> float:
    """The row's memory (fraction of the bf16 full KV) for `metric`: its workload's where the row has
    them (texts and conversations may differ in length, and so in whole blocks)."""
    workload = "reasoning" if metric.startswith("reasoning") else "text"
    return row.get("by_workload", {}).get(workload, row)["memory_fraction_bf16"]


def dtype_styles(rows: list[dict]) -> dict[str, object]:
    dtypes = list(dict.fromkeys(["auto", *(r.get("kv_cache_dtype", "auto") for r in rows)]))
    return {d: LINE_STYLES[i % len(LINE_STYLES)] for i, d in enumerate(dtypes)}


def plot_memory(rows: list[dict], out: Path) -> list[str]:
    """Quality vs memory (fraction of the bf16 full KV) per policy x dtype, a row of panels per
    split; returns the splits plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({r.get("split", "dev") for r in rows}, key=lambda s: (s != "heldout", s))
    compressed = [r for r in rows if r["policy"] != "full"]
    if not compressed:
        raise ValueError("no compressed policy in the results")
    policies = list(dict.fromkeys(r["policy"] for r in compressed))
    colours = {p: f"C{i}" for i, p in enumerate(policies)}
    styles = dtype_styles(rows)
    markers = {d: MARKERS[i % len(MARKERS)] for i, d in enumerate(d for d in styles if d != "auto")}
    fig, axes = plt.subplots(len(splits), len(MEMORY_METRICS), figsize=(5.2 * len(MEMORY_METRICS),
                                                                        3.8 * len(splits)), squeeze=False)
    for ax_row, split in zip(axes, splits, strict=True):
        mine = [r for r in rows if r.get("split", "dev") == split]
        for ax, (metric, title) in zip(ax_row, MEMORY_METRICS.items(), strict=True):
            for policy in policies:
                for dtype, style in styles.items():
                    points = sorted((memory_x(r, metric), r[metric]) for r in mine if r["policy"] == policy
                                    and r["kv_cache_dtype"] == dtype and r.get(metric) is not None)
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, marker="o", linestyle=style, color=colours[policy], label=f"{policy} {dtype}")
            for r in mine:
                if r["policy"] == "full" and r["kv_cache_dtype"] != "auto" and r.get(metric) is not None:
                    ax.plot([memory_x(r, metric)], [r[metric]], marker=markers[r["kv_cache_dtype"]],
                            linestyle="none", color="black", label=f"full KV {r['kv_cache_dtype']}")
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="full KV (f32 reference)")
            ax.axhline(GOAL, color="grey", linestyle=":", linewidth=1, label=f"goal {GOAL}")
            fractions = sorted({r["memory_fraction"] for r in mine if r["policy"] != "full"})
            ax.set_xscale("log", base=2)
            ax.set_xticks(fractions, [f"1/{round(1 / f)}" for f in fractions])
            ax.set_xlabel("KV memory (fraction of the bf16 full KV's bytes)")
            ax.set_title(f"ppl ratio, {title} ({split})", fontsize=10)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    save_figure(fig, out, tight=True)
    return splits


SWEEP_PANELS = {
    "throughput": ("output tok/s", "throughput_full"),
    "mean_running": ("mean running sequences (concurrency)", "mean_running_full"),
}


def plot_sweep(data: dict, out: Path) -> list[str]:
    """Throughput and concurrency vs budget from `bench throughput`'s sweep JSON; returns the policies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = data["sweep"]
    if not points:
        raise ValueError("the sweep has no points")
    policies = list(dict.fromkeys(p["policy"] for p in points))
    budgets = sorted({p["budget_blocks"] for p in points})
    block = data.get("workload", {}).get("block_size")
    fig, axes = plt.subplots(1, len(SWEEP_PANELS), figsize=(4.6 * len(SWEEP_PANELS), 3.8), squeeze=False)
    for ax, (key, (title, full_key)) in zip(axes[0], SWEEP_PANELS.items(), strict=True):
        for policy in policies:
            xs, ys = zip(*sorted((p["budget_blocks"], p[key]) for p in points if p["policy"] == policy), strict=True)
            ax.plot(xs, ys, marker="o", label=policy)
        if data.get(full_key) is not None:
            ax.axhline(data[full_key], color="black", linestyle="--", linewidth=1, label="full KV")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(m) for m in budgets])
        ax.set_xlabel(f"KV budget per sequence (blocks{f' of {block} tokens' if block else ''})")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if data.get("pool_blocks"):
        fig.suptitle(f"one KV pool of {data['pool_blocks']} blocks for every point", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)
    return policies


LONG_PANELS = {"step_ms_by_window": "median step time (ms)", "tokens_per_s_by_window": "output tok/s"}


def is_long(data: dict) -> bool:
    return all(isinstance(data.get(run), dict) and "step_ms_by_window" in data[run] for run in ("compressed", "full"))


def plot_long(data: dict, out: Path) -> list[str]:
    """Step time and tokens/s against generated tokens from `bench long`'s JSON; returns the runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = data["window"]
    runs = {"compressed": f"budget {data.get('budget_tokens')} tokens", "full": "full KV"}
    fig, axes = plt.subplots(1, len(LONG_PANELS), figsize=(4.8 * len(LONG_PANELS), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], LONG_PANELS.items(), strict=True):
        for run, label in runs.items():
            points = [((k + 0.5) * window, y) for k, y in enumerate(data[run][key]) if y is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label, linestyle="-" if run == "compressed" else "--")
        first = data["compressed"].get("first_full_window")
        if first is not None:
            ax.axvline(first * window, color="grey", linewidth=1, linestyle=":",
                       label="first window after the budget fills")
        ax.set_xlabel(f"generated tokens per request (windows of {window})")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    pool = data.get("pool") or {}
    if pool:
        fig.suptitle(f"{data['workload']['requests']} requests, one pool of {pool['blocks']} blocks of "
                     f"{pool['block_size']} tokens for both runs", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)
    return list(runs)


# kind -> (recognises its JSON, default output, plot): plots made from one file alone
SINGLE_FILE_PLOTS = {
    "bench long": (is_long, "docs/long_generation.png", plot_long),
    "throughput sweep": (lambda data: "sweep" in data, "docs/throughput_vs_budget.png", plot_sweep),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("results", type=Path, nargs="+", help="files whose last line is `eval quality`'s JSON, "
                                                             "or one file whose last line is a `bench throughput` "
                                                             "sweep or `bench long`'s JSON")
    parser.add_argument("--out", type=Path, help="default: docs/quality_vs_budget.png (docs/quality_vs_memory.png "
                                                 "for equal-memory results), docs/throughput_vs_budget.png for a "
                                                 "sweep, docs/long_generation.png for `bench long`")
    parser.add_argument("--policies", nargs="+", help="quality plot: only these policies (and full KV)")


def run(args: argparse.Namespace) -> int:
    loaded = [load_json(path) for path in args.results]
    for kind, (matches, default_out, plot_one) in SINGLE_FILE_PLOTS.items():
        if any(matches(data) for data in loaded):
            if len(args.results) != 1:
                usage_error("bench plot", f"give one {kind} file, alone")
            out = args.out or Path(default_out)
            names = plot_one(loaded[0], out)
            print(f"wrote {out} ({', '.join(names)})")
            return 0
    rows = merge(args.results)
    if args.policies:
        rows = [r for r in rows if r["policy"] in {"full", *args.policies}]
    memory = [r for r in rows if row_kind(r) == "memory"]
    tokens = [r for r in rows if row_kind(r) == "tokens"]
    if memory:
        out = args.out or Path("docs/quality_vs_memory.png")
        print(f"wrote {out} (splits: {', '.join(plot_memory(memory, out))})")
        if not any(r["policy"] != "full" for r in tokens):
            return 0
        out = args.out.with_name(f"{args.out.stem}_tokens{args.out.suffix}") if args.out else None
    else:
        out = args.out
    out = out or Path("docs/quality_vs_budget.png")
    metrics = plot(tokens, out)
    print(f"wrote {out} ({', '.join(metrics)})")
    return 0
