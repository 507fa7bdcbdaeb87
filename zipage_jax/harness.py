"""What every benchmark, evaluation and cross-check may share: the run record, timing and
medians, the engine builder and the JSON output. It sits below them all: bench/ may import
evals/ (a benchmark runs an evaluation's tasks), never the reverse, and neither reaches into
the engine past its public API (`LLM`, `LLMEngine`, `EngineCore`, their stats and
`LLMEngine.introspect()`).

    def add_arguments(parser):
        ...
        add_output_arguments(parser)          # --json, --out PATH

    def run(args) -> int:
        llm = build_llm(args.model, **options)   # or build_llm(loaded=loaded, ...) to share one model
        seconds = median_seconds(lambda: llm.generate(prompts, params, use_tqdm=False), runs=3)
        return emit({"seconds": seconds}, args)  # adds "run": run_record()

The run record: {"commit": short hash of HEAD, "-dirty" when tracked files have changes
("unknown" without git or outside a repository), "date": ISO 8601 UTC, "load_average": [1, 5,
15 min] (None where the OS has none), "cpu_count", "platform", "python", "jax": its version (None
when not installed)}. jax is not imported here (importing it fixes its configuration from the
environment, which some benchmarks set first): the version comes from the loaded module or the
installed package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from zipage_jax.llm import LLM
    from zipage_jax.models.loading import LoadedModel

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def git_commit() -> str:
    """Short hash of HEAD, "-dirty" appended when tracked files differ from it; "unknown" without git."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit or "unknown"


def _jax_version() -> str | None:
    module = sys.modules.get("jax")
    if module is not None:
        return getattr(module, "__version__", None)
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("jax")
    except PackageNotFoundError:
        return None


def run_record() -> dict:
    """The "run" object of every JSON result: commit, date, load and the software measured."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # no load average on this OS
        load = None
    return {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": load,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": _jax_version(),
    }


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the result)."""
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s result and its wall-clock seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def median_seconds(fn: Callable[[], Any], runs: int) -> float:
    """The median wall-clock seconds of `runs` calls of fn()."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    return statistics.median(timed(fn)[1] for _ in range(runs))


def interleaved_medians(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    """Median seconds of each named fn, the calls interleaved (a, b, a, b, ...) so that a noisy
    machine's slow spells fall on every side alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(timed(fn)[1])
    return {name: statistics.median(t) for name, t in times.items()}


def build_llm(model: str = "default", *, loaded: LoadedModel | None = None, **options) -> LLM:
    """An LLM with engine `options`; `loaded` shares one already loaded model between engines."""
    from zipage_jax.llm import LLM

    return LLM(model, loaded=loaded, **options)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--json (the result as one line, the last on stdout) and --out PATH (also written there)."""
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line, the last on stdout")
    parser.add_argument("--out", metavar="PATH", help="also write the result's JSON to this file")


def emit(result: dict, args: argparse.Namespace, status: int = 0) -> int:
    """Prints `result` (with "run": run_record() unless it has one) as --json / --out ask, and
    returns `status`, the exit status of the subcommand."""
    result.setdefault("run", run_record())
    text = json.dumps(result, default=str)
    print(text if getattr(args, "json", False) else json.dumps(result, indent=2, default=str), flush=True)
    if getattr(args, "out", None):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return status


def usage_error(command: str, message: str) -> NoReturn:
    """Flags that do not go together: "zipage-jax COMMAND: error: MESSAGE" on stderr and exit
    status 2, as argparse's own errors."""
    print(f"zipage-jax {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    print(json.dumps(run_record()))
