"""Start-up benchmark: process start to the first token, to a fully warmed engine and to a fully
warmed server, cold and warm, this tree against a baseline commit side by side.

    zipage-jax bench startup [--model default] [--baseline 09dcce3 | none] [--runs 3]
                             [--skip first_token,warmup,server,qwen3_8b,baseline_no_warmup] [--json] [--out PATH]
    zipage-jax bench startup --quick --model /path/to/tiny_model --baseline none --json

Every measurement runs in fresh subprocesses (startup_worker.py, or the tree's server; a process
start is part of what is measured), each with a ZIPAGE_JAX_CACHE of its own under a temporary
directory. The model is converted once per
tree (its seconds are reported under "conversion") and its converted entry (the hash-named
directory with hf_config.json) is hard-linked into every fresh cache, so "cold" means an empty
program cache, not an unconverted model; "warm" is a second process on the same cache.

Sections:
  first_token  process start -> first streamed token of LLM(model).stream(PROMPT, temperature 0,
               max_tokens 8), cold and warm; import and engine-construction seconds; the
               programs built and how (compiled, or loaded from the executable store).
  warmup       process start -> LLM(model, warmup=True) returned (the whole grid built), cold and
               warm; per kind of program (forward decode rows / prefill rows, compression,
               history) the summed trace, lower, compile and load seconds.
  server       the tree's server (127.0.0.1, a free port, --kvcache-block-size 32
               --max-num-seqs 64) -> seconds to /health 200, then at once 64 concurrent streaming
               /v1/completions (distinct prompts, max_tokens 16, temperature 0): TTFT p50/p90;
               then seconds until the warm-up grid is built (from /metrics), cold and warm. This
               tree runs the server's default (a background warm-up where the server has one);
               the baseline runs with --warmup, as its users did (/health waits for the whole
               grid), and once, cold, with --no-warmup ("baseline_no_warmup").
  qwen3_8b     compile figures of a Qwen3-8B-shaped model without its weights (parameters are
               ShapeDtypeStructs): a runner on CPU with a small pool builds decode rows 1 and 64,
               prefill rows 64 and the largest compression and history buckets; per program the
               trace/lower/compile seconds, the grid's size, the whole grid's build seconds
               extrapolated per kind, and the process's peak memory (no weights allocated).

Runs are interleaved: current cold, baseline cold, current warm, baseline warm, ... "current"
is a copy of this tree's zipage_jax and pallas_kernels taken at the start (untracked
files included), so an edit during the run cannot turn a warm run cold (the executable store's
key hashes the engine's source). The baseline is a `git worktree add --detach` of --baseline in
a temporary directory (removed at the end). Each tree is first on PYTHONPATH and runs its own
server (`python -m zipage_jax serve`, or scripts/serve_jax.py in a tree that predates the console
script); both run under this Python. "goals" holds each start-up goal's value, limit and whether
it is met, for both trees. --quick (tests): one warm run, a small engine (override with --option NAME=VALUE),
8 streams of 4 tokens and a scaled-down Qwen3 shape; pass a tiny model with --model.
With --json the last line of stdout is one JSON object (with "run": the run record); progress
lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zipage_jax.bench.startup_goals import evaluate_goals
from zipage_jax.bench.startup_metrics import median_fields
from zipage_jax.bench.startup_server import ServerProbe
from zipage_jax.bench.trees import Tree, add_worktree, remove_worktree
from zipage_jax.harness import add_output_arguments, emit, git_commit, log, usage_error
from zipage_jax.models import random_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("startup_worker.py")

PROMPT = "The capital of France is"
FIRST_TOKEN_MAX_TOKENS = 8
DEFAULT_BASELINE = "09dcce3"
SECTIONS = ("first_token", "warmup", "server", "qwen3_8b", "baseline_no_warmup")
SERVER_DEFAULTS = {"kvcache_block_size": 32, "max_num_seqs": 64}  # as in our other server runs
STREAMS, STREAM_TOKENS = 64, 16
QUICK_OPTIONS = {"max_num_seqs": 2, "max_num_batched_tokens": 32, "kvcache_block_size": 16,
                 "num_kvcache_blocks": 32, "max_model_len": 64, "max_compress_seqs": 1}
QUICK_STREAMS, QUICK_STREAM_TOKENS = 8, 4
# environment that would point a worker at a shared compilation cache (the baseline then skips its own)
_SHARED_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")

# Qwen3-8B's shape with its end-of-sequence tokens, as JSON (the worker's spec; rope_scaling None there)
QWEN3_8B = {**{k: v for k, v in random_model.QWEN3_8B.items() if k != "rope_scaling"},
            "eos_token_ids": [151645, 151643]}
QWEN3_QUICK = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
               "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "max_position_embeddings": 512}
QWEN3_OPTIONS = {"kvcache_block_size": 16, "num_kvcache_blocks": 64, "max_num_seqs": 64,
                 "max_num_batched_tokens": 2048}
QWEN3_QUICK_OPTIONS = {"kvcache_block_size": 16, "num_kvcache_blocks": 16, "max_num_seqs": 4,
                       "max_num_batched_tokens": 64, "max_compress_seqs": 1}


def parse_option(text: str) -> tuple[str, object]:
    """NAME=VALUE -> (name, value): JSON when VALUE parses as JSON (4, true, null), else the string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return name.strip().replace("-", "_"), parsed


def server_flags(options: dict) -> list[str]:
    """Engine options as the server's flags (--name-with-dashes VALUE, --flag / --no-flag)."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _programs_line(run: dict) -> str:
    if run.get("programs_compiled") is None:
        return f"programs {run.get('programs_total')} (origin not recorded)"
    return (f"programs {run.get('programs_total')}: compiled {run['programs_compiled']}, "
            f"loaded {run.get('programs_loaded')}")


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> dict:
    """SIGTERM, then SIGKILL after `grace` seconds; how it ended."""
    killed = False
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            killed = True
            proc.wait(30)
    return {"returncode": proc.returncode, "killed": killed}


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, trees: dict[str, Tree]):
        self.args, self.workdir, self.trees = args, workdir, trees
        self.options: dict = args.engine_options
        self.model_entries: dict[str, list[Path]] = {}
        self.conversion: dict[str, dict] = {}
        self.errors: list[str] = []
        self._counter = 0

    # -- plumbing

    def _env(self, tree: Tree, cache: Path, cpu: bool = False) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _SHARED_CACHE_VARIABLES}
        env["ZIPAGE_JAX_CACHE"] = str(cache)
        env["PYTHONPATH"] = os.pathsep.join([str(tree.root), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        if cpu:
            env["JAX_PLATFORMS"] = "cpu"
        return env

    def _name(self, *parts: str) -> Path:
        self._counter += 1
        return self.workdir / "logs" / f"{self._counter:02d}-{'-'.join(parts)}"

    def fresh_cache(self, tree: Tree, label: str) -> Path:
        """An empty program cache holding only the tree's converted model (hard links)."""
        cache = self.workdir / tree.name / label / "cache"
        cache.mkdir(parents=True)
        for entry in self.model_entries.get(tree.name, []):
            shutil.copytree(entry, cache / entry.name, copy_function=_link_or_copy)
        return cache

    def worker(self, kind: str, tree: Tree, cache: Path, label: str, cpu: bool = False, **spec) -> dict:
        """Runs one measuring process; its result with every stamp as seconds since its start."""
        base = self._name(kind, tree.name, label)
        base.parent.mkdir(parents=True, exist_ok=True)
        spec_path, out = base.with_suffix(".spec.json"), base.with_suffix(".out.json")
        log_path = base.with_suffix(".log")
        spec_path.write_text(json.dumps({"kind": kind, "out": str(out), "model": self.args.model,
                                         "options": self.options, **spec}))
        with log_path.open("w") as log_file:
            t0 = time.time()
            # -P: the worker's folder stays off sys.path, zipage_jax comes from the tree on PYTHONPATH
            proc = subprocess.Popen([sys.executable, "-P", str(WORKER), str(spec_path)], cwd=tree.root,
                                    env=self._env(tree, cache, cpu), stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            timed_out = False
            try:
                proc.wait(self.args.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # a timeout, or this process interrupted: the worker (in a session of its own) goes too
                if proc.poll() is None:
                    stop_process(proc, grace=10)
            exited = time.time()
        result = json.loads(out.read_text()) if out.is_file() else {}  # a timed-out worker may leave a partial one
        if timed_out:
            result.update(ok=False, error=f"timed out after {self.args.timeout:g} s")
        elif "ok" not in result:
            result.update(ok=False, error=f"exited with status {proc.returncode} without a result")
        result["returncode"] = proc.returncode
        result["exit_at_s"] = exited - t0
        result["interpreter_s"] = result.pop("started", t0) - t0
        result["at_s"] = {k: v - t0 for k, v in result.pop("stamps", {}).items()}
        imported = result.get("zipage_jax")
        if result.get("ok") and imported and not Path(imported).resolve().is_relative_to(tree.root.resolve()):
            result.update(ok=False, error=f"imported zipage_jax from {imported}, not from the {tree.name} tree "
                                          f"{tree.root}")
        if not result.get("ok"):
            result["log_tail"] = _tail(log_path)
            self.errors.append(f"{kind} {tree.name} {label}: {result.get('error')}")
            log(f"  {kind} {tree.name} {label} FAILED: {result.get('error')} (log: {log_path})")
        return result

    def convert(self) -> None:
        """Converts the model once per tree into a cache of its own (reported under "conversion")."""
        for tree in self.trees.values():
            cache = self.workdir / tree.name / "model-cache"
            cache.mkdir(parents=True)
            result = self.worker("convert", tree, cache, "once")
            entries = sorted(p.parent for p in cache.glob("*/hf_config.json"))
            self.model_entries[tree.name] = entries
            self.conversion[tree.name] = {k: result.get(k) for k in ("ok", "seconds", "load_seconds", "from_cache",
                                                                    "source", "exit_at_s", "error")}
            self.conversion[tree.name]["entries"] = [p.name for p in entries]
            log(f"conversion {tree.name}: {_fmt(result.get('seconds'))} s converting, process "
                f"{_fmt(result.get('exit_at_s'))} s ({len(entries)} cached entr{'y' if len(entries) == 1 else 'ies'})")

    def interleaved(self, section: str, measure) -> dict:
        """measure(tree, cache, label) for every tree: cold on a fresh cache, then --runs warm runs on
        the same cache, current and baseline interleaved."""
        caches = {}
        out = {}
        for tree in self.trees.values():
            caches[tree.name] = self.fresh_cache(tree, section)
            out[tree.name] = {"cold": measure(tree, caches[tree.name], "cold"), "warm": {"runs": []}}
        for i in range(self.args.runs):
            for tree in self.trees.values():
                out[tree.name]["warm"]["runs"].append(measure(tree, caches[tree.name], f"warm{i + 1}"))
        for tree in self.trees.values():
            out[tree.name]["warm"]["median"] = median_fields(out[tree.name]["warm"]["runs"])
        return out

    # -- sections

    def first_token(self) -> dict:
        def measure(tree: Tree, cache: Path, label: str) -> dict:
            r = self.worker("first_token", tree, cache, label, prompt=PROMPT, max_tokens=FIRST_TOKEN_MAX_TOKENS)
            at = r["at_s"]
            run = {"ok": bool(r.get("ok")) and "first_token" in at, "first_token_at_s": at.get("first_token"),
                   "imported_at_s": at.get("imported"), "engine_ready_at_s": at.get("engine_ready"),
                   "done_at_s": at.get("done"), "exit_at_s": r["exit_at_s"], "interpreter_s": r["interpreter_s"]}
            if run["ok"]:
                run["import_s"] = at["imported"] - r["interpreter_s"]
                run["engine_construction_s"] = at["engine_ready"] - at["imported"]
                run["first_token_after_engine_s"] = at["first_token"] - at["engine_ready"]
            programs = r.get("programs") or {}
            run.update(programs_total=programs.get("total"), programs_compiled=programs.get("compiled"),
                       programs_loaded=programs.get("loaded"), tokens=r.get("tokens"), text=r.get("text"),
                       programs=programs, programs_at_first_token=r.get("programs_at_first_token"),
                       zipage_jax=r.get("zipage_jax"))
            self._error_fields(run, r)
            log(f"first_token {tree.name:8s} {label:5s}: first token at {_fmt(run['first_token_at_s'])} s "
                f"(imports {_fmt(run.get('import_s'))} s, engine {_fmt(run.get('engine_construction_s'))} s; "
                f"{_programs_line(run)})")
            return run

        return {"prompt": PROMPT, "max_tokens": FIRST_TOKEN_MAX_TOKENS, "options": self.options,
                **self.interleaved("first_token", measure)}

    def warmup(self) -> dict:
        def measure(tree: Tree, cache: Path, label: str) -> dict:
            r = self.worker("warmup", tree, cache, label)
            at = r["at_s"]
            run = {"ok": bool(r.get("ok")), "ready_at_s": at.get("ready"), "imported_at_s": at.get("imported"),
                   "exit_at_s": r["exit_at_s"], "interpreter_s": r["interpreter_s"]}
            if run["ok"]:
                run["import_s"] = at["imported"] - r["interpreter_s"]
                run["engine_with_warmup_s"] = at["ready"] - at["imported"]
            programs = r.get("programs") or {}
            status = r.get("warmup_status")
            run.update(grid_programs=r.get("grid_programs"), warmup_seconds=(status or {}).get("seconds"),
                       programs_total=programs.get("total"), programs_compiled=programs.get("compiled"),
                       programs_loaded=programs.get("loaded"), build_seconds=programs.get("seconds"),
                       warmup_status=status, by_kind=programs.get("by_kind"), programs_source=programs.get("source"),
                       zipage_jax=r.get("zipage_jax"))
            self._error_fields(run, r)
            log(f"warmup      {tree.name:8s} {label:5s}: warmed at {_fmt(run['ready_at_s'])} s "
                f"(grid {run['grid_programs']}; {_programs_line(run)}; build {_fmt(run['build_seconds'])} s)")
            return run

        return {"options": {**self.options, "warmup": True}, **self.interleaved("warmup", measure)}

    @staticmethod
    def _error_fields(run: dict, r: dict) -> None:
        if not run["ok"]:
            run.update(error=r.get("error") or "no first token", log_tail=r.get("log_tail"),
                       traceback=r.get("traceback"))

    def server(self) -> dict:
        args = self.args
        common = server_flags({**SERVER_DEFAULTS, **self.options})
        modes = {"current": {"flags": common, "warmup": "the server's default: a background warm-up where this "
                             "checkout's server has one (/health 200 once the serving set is ready; grid_done_s "
                             "when /metrics says the whole grid is built); without one grid_done_s is null"}}
        if "baseline" in self.trees:
            modes["baseline"] = {"flags": common + ["--warmup"], "warmup": "--warmup, as its users ran it: "
                                 "/health 200 only once the whole grid is compiled, so grid_done_s = health_s"}
            if "baseline_no_warmup" not in args.skip:
                modes["baseline_no_warmup"] = {"flags": common + ["--no-warmup"], "warmup": "none: programs "
                                               "compile when the first steps need them (cold start only)"}

        def measure_as(mode: str):
            def measure(tree: Tree, cache: Path, label: str) -> dict:
                run = self.run_server(tree, cache, f"{mode}-{label}", modes[mode]["flags"],
                                      grid_from_health=mode == "baseline")
                log(f"server      {mode:8s} {label:5s}: /health 200 at {_fmt(run.get('health_s'))} s, TTFT p50 "
                    f"{_fmt(run.get('ttft_p50_s'), 2)} s p90 {_fmt(run.get('ttft_p90_s'), 2)} s "
                    f"({run.get('succeeded')}/{run.get('streams')} ok), grid built at "
                    f"{_fmt(run.get('grid_done_s'))} s ({run.get('grid_done_from')})")
                return run
            return measure

        caches, out = {}, {}
        for tree in self.trees.values():
            caches[tree.name] = self.fresh_cache(tree, "server")
            out[tree.name] = {"cold": measure_as(tree.name)(tree, caches[tree.name], "cold"), "warm": {"runs": []}}
            if tree.name == "baseline" and "baseline_no_warmup" in modes:
                cache = self.fresh_cache(tree, "server-no-warmup")
                out["baseline_no_warmup"] = {"cold": measure_as("baseline_no_warmup")(tree, cache, "cold")}
        for i in range(args.runs):
            for tree in self.trees.values():
                out[tree.name]["warm"]["runs"].append(measure_as(tree.name)(tree, caches[tree.name], f"warm{i + 1}"))
        for tree in self.trees.values():
            out[tree.name]["warm"]["median"] = median_fields(out[tree.name]["warm"]["runs"])
        return {"streams": args.streams, "max_tokens": args.stream_tokens, "host": "127.0.0.1", "modes": modes,
                **out}

    def run_server(self, tree: Tree, cache: Path, label: str, flags: list[str], grid_from_health: bool) -> dict:
        base = self._name("server", tree.name, label)
        base.parent.mkdir(parents=True, exist_ok=True)
        log_path = base.with_suffix(".log")
        port = _free_port()
        cmd = [*serve_command(tree), "--model", self.args.model, "--served-model-name", "bench", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "info", *flags]
        run: dict = {"ok": False, "flags": flags}
        probe = ServerProbe(self.args.streams, self.args.stream_tokens, self.args.timeout)
        with log_path.open("w") as log_file:
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=tree.root, env=self._env(tree, cache), stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                run.update(asyncio.run(probe.session(proc, f"http://127.0.0.1:{port}", t0)))
            except Exception as exc:  # noqa: BLE001 - reported in the run
                run["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                run["exit"] = stop_process(proc)
        if grid_from_health and run.get("health_s") is not None:
            run["grid_done_s"], run["grid_done_from"] = run["health_s"], "health (--warmup)"
        if not run.get("ok"):
            run["log_tail"] = _tail(log_path)
            self.errors.append(f"server {tree.name} {label}: {run.get('error')}")
            log(f"  server {tree.name} {label} FAILED: {run.get('error')} (log: {log_path})")
        return run

    def qwen3_8b(self) -> dict:
        quick = self.args.quick
        shape = QWEN3_QUICK if quick else QWEN3_8B
        options = QWEN3_QUICK_OPTIONS if quick else QWEN3_OPTIONS
        dtype = self.args.qwen3_dtype
        out = {"model_config": shape, "engine_options": {**options, "dtype": dtype, "compilation_cache_dir": ""},
               "platform": "cpu (JAX_PLATFORMS=cpu)", "scaled_down": quick,
               "weights": "none: Decoder(rngs=None), every parameter a jax.ShapeDtypeStruct",
               "subset": "decode rows smallest and largest, prefill rows largest, the largest compression and "
                         "history buckets, built in grid order through the grid's build callables",
               "extrapolation": "per kind: mean build seconds (trace + lower + compile, timed around each "
                                "program's build) of the measured programs x the programs of that kind in the "
                                "grid; the prefill, compression and history programs measured are their kinds' "
                                "largest, so those estimates are upper bounds; serial seconds (a warm-up builds "
                                "programs on parallel threads)"}
        for tree in self.trees.values():
            cache = self.workdir / tree.name / "qwen3" / "cache"
            cache.mkdir(parents=True)
            r = self.worker("qwen3_8b", tree, cache, "cold", cpu=True, model_config=shape, dtype=dtype,
                            options=options)
            if r.get("ok"):
                before, after = r["params_before"], r["params_after"]
                would_be = before["abstract_gb"]
                r["memory"] = {"peak_rss_gb": r["peak_rss_gb"], "weights_would_be_gb": would_be,
                               "params_abstract": before["abstract_leaves"], "params_real_mb": after["real_mb"],
                               "weights_stayed_abstract": after["abstract_leaves"] == before["abstract_leaves"]
                               and before["abstract_leaves"] > 0,
                               "peak_rss_below_weights": None if would_be < 1 else r["peak_rss_gb"] < would_be}
                total = r["extrapolated"]["estimated_grid_s"]
                log(f"qwen3_8b    {tree.name:8s}: grid {r['grid']['size']} programs, built "
                    f"{len(r['programs'])} in {_fmt(sum(p['build_s'] for p in r['programs']))} s, whole grid "
                    f"~{_fmt(total)} s serial; peak RSS {_fmt(r['peak_rss_gb'], 2)} GB (weights would be "
                    f"{_fmt(would_be, 1)} GB)")
            out[tree.name] = r
        return out

    def run(self) -> dict:
        args = self.args
        results: dict = {}
        engine_sections = [s for s in ("first_token", "warmup", "server") if s not in args.skip]
        if engine_sections:
            self.convert()
        for section in ("first_token", "warmup", "server", "qwen3_8b"):
            if section in args.skip:
                continue
            log(f"== {section}")
            results[section] = getattr(self, section)()
        return results


SNAPSHOT_DIRS = ("zipage_jax", "pallas_kernels")


def serve_command(tree: Tree) -> list[str]:
    """How a tree starts its server: the console script's module, or scripts/serve_jax.py in a tree
    that predates it (either imports the tree's zipage_jax: the tree is first on PYTHONPATH)."""
    if (tree.root / "zipage_jax" / "cli.py").is_file():
        return [sys.executable, "-m", "zipage_jax", "serve"]
    return [sys.executable, str(tree.root / "scripts" / "serve_jax.py")]


def snapshot_tree(path: Path, commit: str) -> Tree:
    """This tree's code as it is now (untracked files included), copied to `path`: every run
    measures the same code, however the working tree changes meanwhile (the executable store's
    key hashes the engine's source: an edit between a cold and a warm run would make it cold)."""
    for name in SNAPSHOT_DIRS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, path / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return Tree("current", path, commit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", default="default", help="the model of every engine and server (default: default)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="COMMIT",
                        help=f"the commit to compare with (default: {DEFAULT_BASELINE}); none: this tree only")
    parser.add_argument("--runs", type=int, default=None, help="warm runs of each measurement (default: 3; --quick 1)")
    parser.add_argument("--skip", action="append", default=[], metavar="SECTIONS",
                        help=f"comma-separated sections to skip: {', '.join(SECTIONS)}")
    parser.add_argument("--option", action="append", type=parse_option, default=[], metavar="NAME=VALUE",
                        help="an engine option for every engine and server (repeat; e.g. max_num_seqs=8)")
    parser.add_argument("--streams", type=int, default=None,
                        help=f"concurrent streams sent to a new server (default: {STREAMS}; --quick {QUICK_STREAMS})")
    parser.add_argument("--stream-tokens", type=int, default=None,
                        help=f"max_tokens of each stream (default: {STREAM_TOKENS}; --quick {QUICK_STREAM_TOKENS})")
    parser.add_argument("--qwen3-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds any one process or server may take (default: 1800; --quick 300)")
    parser.add_argument("--quick", action="store_true",
                        help="the tests' settings: one warm run, a small engine config, 8 streams of 4 tokens, a "
                             "scaled-down Qwen3 shape (pass a tiny model with --model)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (caches and logs)")
    add_output_arguments(parser)


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with their defaults filled in (--quick's or the full run's), the sections to skip as a
    set and the engine options as a dict; a usage error for values out of range."""
    args.skip = {s.strip() for item in args.skip for s in item.split(",") if s.strip()}
    unknown = args.skip - set(SECTIONS)
    if unknown:
        usage_error("bench startup", f"--skip: unknown section(s) {', '.join(sorted(unknown))}; choose from "
                                     f"{', '.join(SECTIONS)}")
    quick = args.quick
    args.runs = args.runs if args.runs is not None else (1 if quick else 3)
    args.streams = args.streams or (QUICK_STREAMS if quick else STREAMS)
    args.stream_tokens = args.stream_tokens or (QUICK_STREAM_TOKENS if quick else STREAM_TOKENS)
    args.timeout = args.timeout or (300.0 if quick else 1800.0)
    if args.runs < 1 or args.streams < 1 or args.stream_tokens < 1:
        usage_error("bench startup", "--runs, --streams and --stream-tokens must be >= 1")
    args.engine_options = {**(QUICK_OPTIONS if quick else {}), **dict(args.option)}
    if args.baseline.lower() == "none":
        args.baseline = None
    return args


def run(args: argparse.Namespace) -> int:
    args = with_defaults(args)
    workdir = Path(tempfile.mkdtemp(prefix="bench_startup-"))
    trees = {"current": snapshot_tree(workdir / "current-tree", git_commit())}
    baseline_path = workdir / "baseline-tree"
    summary: dict = {"model": args.model, "quick": args.quick, "runs": args.runs, "engine_options": args.engine_options,
                     "skipped": sorted(args.skip)}
    try:
        if args.baseline is not None:
            trees["baseline"] = add_worktree(args.baseline, baseline_path)
        summary["trees"] = {name: {"commit": t.commit} for name, t in trees.items()}
        summary["trees"]["current"]["source"] = f"a copy of {', '.join(SNAPSHOT_DIRS)} of {ROOT} taken at the start"
        if args.baseline is not None:
            summary["trees"]["baseline"]["requested"] = args.baseline
        log(f"bench startup: model {args.model}, trees {', '.join(f'{n} {t.commit}' for n, t in trees.items())}, "
            f"{args.runs} warm run(s), work in {workdir}")
        bench = Bench(args, workdir, trees)
        summary.update(bench.run())
        summary["conversion"] = bench.conversion or None
        summary["goals"] = evaluate_goals(summary, trees)
        summary["errors"] = bench.errors
    finally:
        if args.baseline is not None and baseline_path.exists():
            remove_worktree(baseline_path)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    verdicts = {True: "met", False: "not met", None: "not measured"}
    for name, goal in summary["goals"].items():
        log(f"goal {name} <= {goal['goal']:g} s: " + ", ".join(
            f"{tree} {_fmt(goal[tree]['value'])} s ({verdicts[goal[tree]['met']]})"
            for tree in ("current", "baseline") if goal[tree] is not None))
    return emit(summary, args, status=1 if summary["errors"] else 0)
