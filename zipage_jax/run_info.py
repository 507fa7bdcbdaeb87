"""The run metadata every JSON result of scripts/ carries under its "run" key.

    from zipage_jax.run_info import run_info
    summary["run"] = run_info()

{"commit": short hash of HEAD, "-dirty" when tracked files have changes ("unknown" without git
or outside a repository), "date": ISO 8601 UTC, "load_average": [1, 5, 15 min] (None where the
OS has none), "cpu_count", "platform", "python", "jax": its version (None when not installed)}.
jax is not imported here (importing it fixes its configuration from the environment, which
some scripts set first): the version comes from the loaded module or the installed package.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

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


def run_info() -> dict:
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


if __name__ == "__main__":
    import json

    print(json.dumps(run_info()))
