"""The dependency direction of docs/ALGORITHM.md ("Code layout"): no import runs back up; the
server, benchmarks, evaluations and cross-checks use only the engine's public API; and no file
puts itself on sys.path."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = [
    ("kernels", ["pallas_kernels"]),
    ("backend", ["zipage_jax.backend"]),
    ("layers", ["zipage_jax.layers"]),
    ("models", ["zipage_jax.models"]),
    ("compress", ["zipage_jax.compress"]),
    ("options", ["zipage_jax.config", "zipage_jax.sampling_params"]),
    ("engine", ["zipage_jax.engine"]),
    # data-parallel serving: replicas of the engine on Ray; the server never imports it (the commands do)
    ("data_parallel", ["zipage_jax.data_parallel"]),
    ("api", ["zipage_jax.llm", "zipage_jax.chat", "zipage_jax.cli_options", "zipage_jax"]),
    ("server", ["zipage_jax.server"]),
    # the tools: what they share (run record, timing, output), then cross-checks against reference
    # implementations, evaluations and benchmarks (which may run an evaluation's tasks, not the reverse)
    ("harness", ["zipage_jax.harness"]),
    ("crosscheck", ["zipage_jax.crosscheck"]),
    ("evals", ["zipage_jax.evals"]),
    ("bench", ["zipage_jax.bench"]),
    ("commands", ["zipage_jax.cli", "zipage_jax.__main__", "zipage_jax.commands", "zipage_jax.crosscheck.__main__"]),
]
# What the server may use of the engine: its public API (the in-process engine, and the engine core's
# boundary: its outputs, the driver loop, the wire format, the output stage), not the scheduler,
# runner or kernels.
SERVER_MAY_IMPORT = ("zipage_jax.engine.llm_engine", "zipage_jax.engine.outputs", "zipage_jax.engine.stats",
                     "zipage_jax.engine.admission", "zipage_jax.engine.core", "zipage_jax.engine.core_outputs",
                     "zipage_jax.engine.driver", "zipage_jax.engine.wire", "zipage_jax.engine.output_processor",
                     # the tokenizer of the model the engine core loads in its own process
                     "zipage_jax.models.loading")
TOOLS = ("harness", "crosscheck", "evals", "bench")
# What the tools may use of the engine: the in-process engine and the engine core, their outputs,
# stats and introspection, and the pool's sizing arithmetic; never the runner, the scheduler or
# the block manager, whether imported or reached as an attribute (INTERNALS).
TOOLS_MAY_IMPORT = ("zipage_jax.engine.llm_engine", "zipage_jax.engine.core", "zipage_jax.engine.outputs",
                    "zipage_jax.engine.stats", "zipage_jax.engine.introspection", "zipage_jax.engine.pool_plan")
INTERNALS = ("runner", "scheduler", "block_manager")
# Run by its path in this tree and in older commits' checkouts, it measures the runner's program
# grid itself (an 8B-shaped runner without weights) and reads the records of older runners.
TOOLS_EXEMPT = ("zipage_jax.bench.startup_worker",)
HOST_ONLY = ["zipage_jax.engine.sequence", "zipage_jax.engine.block_manager", "zipage_jax.engine.scheduler",
             "zipage_jax.engine.runner.results"]


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the most specific prefix of `module`; None for third-party modules."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` imports that module
            found += dict.fromkeys((node.lineno, f"{node.module}.{alias.name}"
                                    if is_module(f"{node.module}.{alias.name}") else node.module)
                                   for alias in node.names)
    return found


def is_module(name: str) -> bool:
    """`name` is a module or package of this repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_imports(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        source = module_name(path)
        here = layer_of(source)
        for line, target in imports(path):
            there = layer_of(target)
            if there is None:
                continue
            if there > here:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[here][0]}) imports {target} "
                           f"({LAYERS[there][0]})")
            elif LAYERS[here][0] == "server" and LAYERS[there][0] not in ("server", "api", "options") \
                    and not target.startswith(SERVER_MAY_IMPORT):
                bad.append(f"{path.relative_to(ROOT)}:{line}: the server reaches past the engine API to {target}")
            elif LAYERS[here][0] in TOOLS and LAYERS[there][0] == "engine" and source not in TOOLS_EXEMPT \
                    and not target.startswith(TOOLS_MAY_IMPORT):
                bad.append(f"{path.relative_to(ROOT)}:{line}: a tool reaches past the engine API to {target}")
    return bad


def internal_reads(files: list[Path]) -> list[str]:
    """Every `x.runner`, `x.scheduler` and `x.block_manager` in the tools' files (the engine's
    internals, read past its API), but TOOLS_EXEMPT's."""
    bad = []
    for path in files:
        source = module_name(path)
        here = layer_of(source)
        if here is None or LAYERS[here][0] not in TOOLS or source in TOOLS_EXEMPT:
            continue
        reads = [node for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr in INTERNALS]
        bad += [f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}"
                for node in sorted(reads, key=lambda node: node.lineno)]
    return bad


def sys_path_edits(files: list[Path]) -> list[str]:
    """Every change to sys.path: a call of one of its methods (insert, append, ...), or an
    assignment to it or to a slice of it."""
    def is_sys_path(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
            and node.value.id == "sys"

    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                changed = is_sys_path(node.func.value)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                changed = any(is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets)
            else:
                changed = False
            if changed:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return bad


def project_files() -> list[Path]:
    return sorted((ROOT / "zipage_jax").rglob("*.py")) + sorted((ROOT / "pallas_kernels").rglob("*.py"))


def test_no_import_runs_back_up():
    assert upward_imports(project_files()) == []


def test_the_tools_read_no_engine_internals():
    assert internal_reads(project_files()) == []


def test_no_file_puts_itself_on_sys_path():
    files = [p for folder in ("zipage_jax", "tests", "scripts") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100 and sys_path_edits(files) == []


def test_kernels_import_only_jax_and_numpy():
    allowed = {"jax", "numpy", "pallas_kernels", "__future__"}
    bad = [f"{path.name}:{line} imports {target}" for path in sorted((ROOT / "pallas_kernels").rglob("*.py"))
           for line, target in imports(path)
           if target.split(".")[0] not in allowed and target.split(".")[0] not in sys.stdlib_module_names]
    assert bad == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    # positive control: a layers/ module importing the engine, and the server importing the scheduler
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "zipage_jax" / "layers").mkdir(parents=True)
    (tmp_path / "zipage_jax" / "server").mkdir()
    (tmp_path / "zipage_jax" / "layers" / "bad.py").write_text("from zipage_jax.engine.runner import ModelRunner\n")
    (tmp_path / "zipage_jax" / "server" / "bad.py").write_text("import zipage_jax.engine.scheduler\n")
    (tmp_path / "zipage_jax" / "engine").mkdir()
    (tmp_path / "zipage_jax" / "engine" / "scheduler.py").write_text("")
    (tmp_path / "zipage_jax" / "server" / "bad_from.py").write_text("from zipage_jax.engine import scheduler\n")
    found = upward_imports(project_files())
    assert len(found) == 3 and "(layers) imports zipage_jax.engine.runner (engine)" in found[0]
    assert all("reaches past the engine API to zipage_jax.engine.scheduler" in f for f in found[1:])


def test_the_server_and_data_parallel_serving_do_not_import_each_other(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for package in ("server", "data_parallel", "commands"):
        (tmp_path / "zipage_jax" / package).mkdir(parents=True)
    (tmp_path / "zipage_jax" / "server" / "bad.py").write_text("import zipage_jax.data_parallel.router\n")
    (tmp_path / "zipage_jax" / "data_parallel" / "bad.py").write_text("from zipage_jax.server import create_app\n")
    (tmp_path / "zipage_jax" / "commands" / "fine.py").write_text("import zipage_jax.data_parallel.router\n")
    found = upward_imports(project_files())
    assert len(found) == 2
    assert "(data_parallel) imports zipage_jax.server (server)" in found[0]
    assert "server/bad.py:1: the server reaches past the engine API to zipage_jax.data_parallel.router" in found[1]


@pytest.mark.parametrize("module", HOST_ONLY)
def test_host_only_modules_load_without_jax(module):
    code = f"import sys, json, {module}; print(json.dumps('jax' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def test_the_check_keeps_the_tools_apart_and_off_the_engine_internals(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for package in ("harness", "crosscheck", "evals", "bench", "engine"):
        (tmp_path / "zipage_jax" / package).mkdir(parents=True)
    (tmp_path / "zipage_jax" / "engine" / "scheduler.py").write_text("")
    planted = {
        "evals/bad.py": "from zipage_jax.bench.throughput import run_benchmark\n",
        "crosscheck/bad.py": "import zipage_jax.evals.datasets\n",
        "harness/bad.py": "from zipage_jax.crosscheck.reference import load_reference_model\n",
        "bench/bad_runner.py": "from zipage_jax.engine.runner.model_runner import ModelRunner\n",
        "bench/bad_scheduler.py": "from zipage_jax.engine import scheduler\n",
        # what the tools may import: the harness, an evaluation from a benchmark, the public engine
        "bench/fine.py": "from zipage_jax.harness import emit\nimport zipage_jax.evals.code\n"
                         "from zipage_jax.engine.llm_engine import LLMEngine\n",
        "evals/fine.py": "from zipage_jax.harness import run_record\nfrom zipage_jax.crosscheck import reference\n",
    }
    for name, text in planted.items():
        (tmp_path / "zipage_jax" / name).write_text(text)
    found = upward_imports(project_files())
    assert len(found) == 5, found
    assert "bench/bad_runner.py:1: a tool reaches past the engine API to zipage_jax.engine.runner" in found[0]
    assert "bench/bad_scheduler.py:1: a tool reaches past the engine API to zipage_jax.engine.scheduler" in found[1]
    assert "crosscheck/bad.py:1 (crosscheck) imports zipage_jax.evals.datasets (evals)" in found[2]
    assert "evals/bad.py:1 (evals) imports zipage_jax.bench.throughput (bench)" in found[3]
    assert "harness/bad.py:1 (harness) imports zipage_jax.crosscheck.reference (crosscheck)" in found[4]


def test_the_check_catches_a_tool_reading_engine_internals(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "zipage_jax" / "bench").mkdir(parents=True)
    (tmp_path / "zipage_jax" / "server").mkdir()
    (tmp_path / "zipage_jax" / "bench" / "bad.py").write_text(
        "jax.block_until_ready(llm.engine.core.runner.state)\n"
        "free = engine.core.block_manager.num_free_blocks\n"
        "waiting = engine.core.scheduler.waiting\n"
        "stats = engine.get_stats().num_free_blocks\n")  # the public way: not reported
    (tmp_path / "zipage_jax" / "server" / "fine.py").write_text("x = engine.core.runner\n")  # not a tool
    assert internal_reads(project_files()) == ["zipage_jax/bench/bad.py:1 reads .runner",
                                               "zipage_jax/bench/bad.py:2 reads .block_manager",
                                               "zipage_jax/bench/bad.py:3 reads .scheduler"]


def test_the_check_catches_a_file_on_sys_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'a')\nsys.path.append('b')\nsys.path += ['c']\n"
                   "sys.path[:0] = ['d']\nsys.path = ['e']\n")
    fine = tmp_path / "fine.py"
    fine.write_text("import sys\nprint(sys.path)\nmonkeypatch.syspath_prepend('x')\npaths = list(sys.path)\n"
                    "sys.path[0].startswith('/')\n")
    assert sorted(sys_path_edits([bad, fine])) == [f"bad.py:{line}" for line in range(2, 7)]
