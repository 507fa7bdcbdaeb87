"""`bench engine --baseline COMMIT`: this tree's decode step against a baseline commit's, in turns.

Each round runs `zipage-jax bench engine` (the same model, batches, tokens and --runs, HF skipped)
once in this tree and once in a checkout of COMMIT, each in a process of its own, so that both
see the same machine load; the figures are the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from zipage_jax.bench.trees import ROOT, Tree, add_worktree, remove_worktree
from zipage_jax.harness import git_commit, log, usage_error

DECODE_GOAL = 1.05  # this tree's decode step at most this much of the baseline's: within noise or better


def run_against_baseline(args: argparse.Namespace) -> dict:
    if not args.skip_hf:
        usage_error("bench engine", "--baseline compares the engine alone: add --skip-hf")
    if args.rounds < 1:
        usage_error("bench engine", "--rounds must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="bench_engine-"))
    trees = [Tree("current", ROOT, git_commit())]
    runs: dict[str, list[dict]] = {"current": [], "baseline": []}
    try:
        trees.append(add_worktree(args.baseline, workdir / "baseline-tree"))
        for round_ in range(args.rounds):
            for tree in trees:
                log(f"round {round_ + 1}/{args.rounds}: {tree.name} ({tree.commit[:12]})")
                runs[tree.name].append(_run(tree, args))
    finally:
        remove_worktree(workdir / "baseline-tree")
    batches = [str(b) for b in args.batches]
    medians = {name: {b: {key: statistics.median(r["batches"][b][key] for r in tree_runs)
                          for key in ("decode_step_ms", "zipage_tok_s")} for b in batches}
               for name, tree_runs in runs.items()}
    ratios = {b: {"decode_step": medians["current"][b]["decode_step_ms"] / medians["baseline"][b]["decode_step_ms"],
                  "tok_s": medians["current"][b]["zipage_tok_s"] / medians["baseline"][b]["zipage_tok_s"]}
              for b in batches}
    goals = {f"decode_step_batch_{b}": {"value": round(r["decode_step"], 3), "bound": f"<= {DECODE_GOAL}",
                                        "met": r["decode_step"] <= DECODE_GOAL} for b, r in ratios.items()}
    for name, goal in goals.items():
        log(f"goal {name}: {goal['value']} ({goal['bound']}) {'met' if goal['met'] else 'MISSED'}")
    return {"model": args.model, "new_tokens": args.new_tokens, "runs": args.runs, "rounds": args.rounds,
            "trees": {t.name: t.commit for t in trees}, "medians": medians, "ratios": ratios, "goals": goals,
            "all_runs": runs}


def _run(tree: Tree, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "zipage_jax", "bench", "engine", "--model", args.model, "--batches",
               *map(str, args.batches), "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--skip-hf",
               "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(command, cwd=tree.root, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"bench engine in the {tree.name} tree exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
