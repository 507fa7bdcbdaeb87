"""The source trees a benchmark compares: this one, and a baseline commit checked out beside it
(`git worktree add --detach`), each run in processes of its own with PYTHONPATH at its root."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Tree:
    name: str  # "current" or "baseline"
    root: Path
    commit: str


def add_worktree(commit: str, path: Path) -> Tree:
    """`commit` checked out at `path` (SystemExit naming --baseline when it is not a commit)."""
    resolved = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    if resolved.returncode:
        raise SystemExit(f"--baseline {commit}: not a commit of {ROOT}: {resolved.stderr.strip()}")
    full = resolved.stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", str(path), full], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    return Tree("baseline", path, full)


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True, timeout=300)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True, timeout=60)
