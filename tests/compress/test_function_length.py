"""Every function in zipage_jax/compress stays short: at most MAX_LINES from its def line to its
last line (docstring included), measured with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import zipage_jax.compress

MAX_LINES = 50
COMPRESS_DIR = Path(zipage_jax.compress.__file__).parent


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_measure_finds_a_long_function_and_passes_one_at_the_limit():
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    planted = function("at_limit", MAX_LINES) + "\n\nclass Holder:\n" + function("planted", MAX_LINES + 1).replace(
        "\n", "\n    ").replace("def", "    def", 1)
    assert long_functions(planted) == [("planted", MAX_LINES + 1)]
    assert long_functions(function("at_limit", MAX_LINES)) == []


def test_no_function_in_compress_is_longer_than_the_limit():
    files = sorted(COMPRESS_DIR.glob("*.py"))
    assert len(files) >= 5  # the package was found
    found = {f.name: long_functions(f.read_text()) for f in files}
    assert {name: funcs for name, funcs in found.items() if funcs} == {}
