"""A process that built an engine exits with status 0: right after building it, after a warm-up,
and while a warm-up still builds. Every thread the engine starts (zeroing the device state, the
warm-up's workers, a program built ahead) has finished or stopped before the interpreter shuts
the runtime down; one still inside it then aborts the process (status 134, "terminate called
after throwing an instance of ...")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A small grid (a warm-up of seconds) over a pool of 1 GB: zeroing it outlasts the rest of
# building the engine.
OPTIONS = dict(kvcache_block_size=16, kvcache_memory_gb=1.0, max_num_seqs=2, max_num_batched_tokens=32,
               max_model_len=64, max_cache_blocks_per_seq=2, max_compress_seqs=1, query_cache_len=4)


def assert_exits_cleanly(code: str) -> None:
    """A process running `code` exits with status 0 (the abort is a race: it shows in most runs,
    not in every one)."""
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-600:]


def build(model: Path, **options) -> str:
    """Code that builds an engine."""
    return f"from zipage_jax import LLM\n\nllm = LLM({str(model)!r}, **{dict(OPTIONS, **options)!r})\n"


def test_exit_right_after_building_an_engine(llama_dir):
    assert_exits_cleanly(build(llama_dir))


@pytest.mark.slow  # the first run compiles the grid for the second
def test_exit_after_a_warmup(llama_dir, tmp_path):
    code = build(llama_dir, warmup=True, compilation_cache_dir=str(tmp_path))
    assert_exits_cleanly(code)
    assert_exits_cleanly(code)  # its programs load from the store: the warm-up ends before the zeroing


def test_exit_while_a_background_warmup_builds(llama_dir):
    assert_exits_cleanly(build(llama_dir, compilation_cache_dir="") + "llm.engine.start_warmup()\n")


def test_exit_while_a_warmup_runs_on_another_thread(llama_dir):
    """The thread hands its engine over: a daemon thread that frees device buffers while the
    interpreter exits aborts any jax process, whatever the engine does."""
    options = dict(OPTIONS, warmup=True, compilation_cache_dir="")
    assert_exits_cleanly(f"""
import threading
import time

from zipage_jax import LLM

built = []
thread = threading.Thread(target=lambda: built.append(LLM({str(llama_dir)!r}, **{options!r})), daemon=True)
thread.start()
while thread.is_alive() and not any(t.name.startswith("zipage-warmup") for t in threading.enumerate()):
    time.sleep(0.01)
assert thread.is_alive() or built, "building the engine failed"
""")
