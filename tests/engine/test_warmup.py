"""Warm-up: the serving set first, programs built side by side, steps padded up to a ready
bucket while the rest compile, and the decode program built beside the first prefill."""

from __future__ import annotations

import threading
import time

import pytest

from zipage_jax import LLM, SamplingParams
from zipage_jax.engine.runner.forward import layers_per_group
from zipage_jax.engine.runner.grid import GridProgram
from zipage_jax.engine.runner.warmup import Warmup

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128, max_cache_blocks_per_seq=2, max_compress_seqs=2, query_cache_len=4,
               compilation_cache_dir="")
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # past the budget: compactions


@pytest.mark.parametrize("depth, size", [(30, 6), (36, 6), (2, 2), (16, 8), (7, 7), (11, 1), (1, 1)])
def test_layer_groups_divide_the_depth(depth, size):
    assert layers_per_group(depth) == size


def test_the_grid_puts_the_largest_bucket_of_each_kind_first(llama_dir):
    runner = LLM(str(llama_dir), **OPTIONS).engine.core.runner
    grid = runner.step_grid()
    serving = [p for p in grid if p.serving]
    assert grid[:len(serving)] == serving and len({p.key for p in grid}) == len(grid)
    assert {p.key for p in serving} == {("decode rows", 4), ("prefill rows", 2), ("batch", 2, "blocks", 8),
                                        ("tokens", 128)}
    for p in grid:  # every program fits in the serving one of its kind
        big = next(s for s in serving if s.key[0::2] == p.key[0::2])
        assert all(b >= k for b, k in zip(big.key[1::2], p.key[1::2]))


def test_steps_pad_up_to_the_serving_set_and_compile_nothing(llama_dir):
    full = LLM(str(llama_dir), warmup=True, **OPTIONS)
    grid = len(full.engine.core.runner.step_grid())
    assert full.engine.warmup_status.done and full.engine.warmup_status.ready == grid
    expected = full.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]

    partial = LLM(str(llama_dir), **OPTIONS)
    runner = partial.engine.core.runner
    Warmup([p for p in runner.step_grid() if p.serving]).run()
    built = runner.num_compiles
    got = partial.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert got["token_ids"] == expected and got["metrics"]["num_compressions"] > 0
    assert runner.num_compiles == built  # one sequence ran in the 4-row decode and 2-row prefill programs
    assert not runner.forward.ready(("decode rows", 1))


def test_a_background_warmup_serves_while_it_builds(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    assert llm.engine.warmup_status is None
    warmup = llm.engine.start_warmup()
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]  # while it builds
    assert len(out["token_ids"]) == GREEDY.max_tokens
    assert warmup.wait_serving(timeout=600)
    warmup.wait()
    status = llm.engine.warmup_status
    assert status.done and status.serving_ready and status.failed == 0 and status.seconds > 0
    assert status.ready == status.total == len(llm.engine.core.runner.step_grid())
    runner = llm.engine.core.runner
    assert runner.num_compiles == len(runner.records) > status.total  # stages count apart


def test_the_first_prefill_builds_the_decode_program_beside_it(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    runner = llm.engine.core.runner
    started = {}
    real = runner.forward.get

    def get(key, *args):
        started.setdefault(key, threading.current_thread().name)
        return real(key, *args)

    runner.forward.get = get
    llm.generate([[4, 5, 6]], GREEDY, use_tqdm=False)
    assert started[("prefill rows", 1)] == threading.main_thread().name
    assert started[("decode rows", 1)].startswith("zipage-prefetch")


def _programs(kinds: list[tuple[str, bool]], built: list, gate: threading.Event | None = None,
              fail: str | None = None, seconds: float = 0.0) -> list[GridProgram]:
    def build(name):
        if gate is not None:
            gate.wait(10)
        time.sleep(seconds)
        if name == fail:
            raise RuntimeError("broken program")
        built.append((name, threading.current_thread().name))

    return [GridProgram("forward", ("rows", i), lambda n=name: build(n), serving) for i, (name, serving)
            in enumerate(kinds)]


def test_workers_build_every_program_and_count_failures():
    built = []
    grid = _programs([("a", True), ("b", True), ("c", False), ("d", False), ("e", False)], built, fail="d")
    seen = []
    warmup = Warmup(grid, workers=2).run(seen.append)
    status = warmup.status
    assert sorted(n for n, _ in built) == ["a", "b", "c", "e"] and sum(seen) == 5
    assert (status.total, status.ready, status.failed, status.done, status.serving_ready) == (5, 4, 1, True, True)
    assert len({t for _, t in built}) <= 2


def test_serving_ready_comes_before_the_rest_and_stop_builds_no_more():
    built, gate = [], threading.Event()
    grid = _programs([("serve", True)] + [(f"p{i}", False) for i in range(6)], built, gate, seconds=0.1)
    warmup = Warmup(grid, workers=1).start()
    assert not warmup.wait_serving(timeout=0.05) and not warmup.status.serving_ready
    gate.set()
    assert warmup.wait_serving(timeout=10) and built[0][0] == "serve"
    warmup.stop()
    assert warmup.status.done and warmup.status.ready == len(built) < len(grid)


def test_the_warmup_yields_to_requests_past_the_serving_set(monkeypatch):
    from zipage_jax.engine.runner import warmup as warmup_module

    built, busy = [], threading.Event()
    busy.set()
    grid = _programs([("serve", True), ("small", False)], built)
    warmup = Warmup(grid, workers=1, busy=busy.is_set).start()
    assert warmup.wait_serving(timeout=10)
    time.sleep(0.3)
    assert [n for n, _ in built] == ["serve"]  # the engine is busy: nothing more starts
    busy.clear()
    warmup.wait()
    assert [n for n, _ in built] == ["serve", "small"]

    monkeypatch.setattr(warmup_module, "MAX_YIELD_S", 0.2)
    built.clear()
    busy.set()  # never idle: it waits MAX_YIELD_S, then builds anyway
    Warmup(_programs([("small", False)], built), workers=1, busy=busy.is_set).run()
    assert [n for n, _ in built] == ["small"]
