"""Compiled programs persist: a restart loads them (no trace, no compile) and decodes the same
tokens; anything that shapes a program changes the key; a damaged entry compiles again."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from zipage_jax import LLM, SamplingParams
from zipage_jax.config import EngineConfig
from zipage_jax.engine.runner import executable_store

AVX512 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx2 avx512f\ncpu MHz\t\t: 2000\n"
AVX2 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx2\ncpu MHz\t\t: 2000\n"
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=24, max_num_seqs=2, max_num_batched_tokens=32,
               max_model_len=96, max_cache_blocks_per_seq=2, max_compress_seqs=1)
PROMPTS = [[5, 9, 14, 3, 7] * 4, [8, 1, 2]]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # past the budget: compactions


def test_the_fingerprint_follows_the_instruction_set_not_the_clock():
    assert executable_store.host_fingerprint(AVX512) != executable_store.host_fingerprint(AVX2)
    assert executable_store.host_fingerprint(AVX512) == executable_store.host_fingerprint(
        AVX512.replace("2000", "3100") + AVX512.replace("processor\t: 0", "processor\t: 1"))


def test_the_default_directory_is_under_the_cache_per_host(monkeypatch, tmp_path):
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(tmp_path))
    assert executable_store.default_directory() == tmp_path / "executables" / executable_store.host_fingerprint()
    assert executable_store.store_directory(None) == executable_store.default_directory()
    assert executable_store.store_directory("") is None
    assert executable_store.store_directory(str(tmp_path / "x")) == tmp_path / "x"


def _origins(llm: LLM) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in llm.engine.core.runner.records:
        counts[record.origin] = counts.get(record.origin, 0) + 1
    return counts


def _run(llm: LLM) -> list[list[int]]:
    return [r["token_ids"] for r in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_a_restart_loads_every_program_and_decodes_the_same_tokens(llama_dir, tmp_path):
    store = str(tmp_path / "store")
    first = LLM(str(llama_dir), compilation_cache_dir=store, **OPTIONS)
    expected = _run(first)
    assert first.engine.get_stats().num_compressions > 0  # the compression program is in the store too
    built = _origins(first)
    assert built.get("compiled", 0) >= 5 and "loaded" not in built
    names = {r.name for r in first.engine.core.runner.records}
    assert names == {"embed", "layers", "head", "compression"}

    # host-only options (logging, scheduling, prefix caching) share the programs
    again = LLM(str(llama_dir), compilation_cache_dir=store, log_interval_s=1.0, enable_prefix_caching=False,
                async_scheduling=False, **OPTIONS)
    assert _run(again) == expected
    assert _origins(again) == {"loaded": built["compiled"]}
    assert all(r.trace_seconds == r.lower_seconds == r.compile_seconds == 0 and r.load_seconds > 0
               for r in again.engine.core.runner.records)
    stats = again.engine.get_stats()
    assert stats.num_programs_loaded == stats.num_compiles == built["compiled"] and stats.compile_seconds > 0


RESTART_ON_SEVERAL_DEVICES = """
import json, sys
import jax
from zipage_jax import LLM, SamplingParams
options = json.loads(sys.argv[3])
params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
runs = []
for _ in range(2):  # the second engine loads the first one's programs
    llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], **options)
    tokens = [r["token_ids"] for r in llm.generate(json.loads(sys.argv[4]), params, use_tqdm=False)]
    runs.append({"tokens": tokens, "origins": sorted({r.origin for r in llm.engine.core.runner.records})})
print(json.dumps({"devices": jax.device_count(), "runs": runs}))
"""


def test_a_restart_on_a_machine_of_several_devices_loads_onto_the_engines_device(llama_dir, tmp_path):
    """One device of four: the stored programs load onto the engine's device, not onto every one."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
                        + " --xla_force_host_platform_device_count=4")
    run = subprocess.run([sys.executable, "-c", RESTART_ON_SEVERAL_DEVICES, str(llama_dir), str(tmp_path / "store"),
                          json.dumps(OPTIONS), json.dumps(PROMPTS)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    first, again = out["runs"]
    assert out["devices"] == 4
    assert first["origins"] == ["compiled"] and again["origins"] == ["loaded"]
    assert again["tokens"] == first["tokens"]


def test_what_shapes_a_program_changes_the_key(llama_dir, tmp_path, monkeypatch):
    store = str(tmp_path / "store")
    LLM(str(llama_dir), compilation_cache_dir=store, **OPTIONS).generate(PROMPTS[1], PARAMS, use_tqdm=False)
    other = LLM(str(llama_dir), compilation_cache_dir=store, **{**OPTIONS, "query_cache_len": 8})
    other.generate(PROMPTS[1], PARAMS, use_tqdm=False)
    assert "loaded" not in _origins(other)  # a device-side option: its own programs
    monkeypatch.setattr(executable_store, "source_fingerprint", lambda: "another version of the engine")
    edited = LLM(str(llama_dir), compilation_cache_dir=store, **OPTIONS)
    edited.generate(PROMPTS[1], PARAMS, use_tqdm=False)
    assert "loaded" not in _origins(edited)  # changed engine source never loads an old program
    assert len(list((tmp_path / "store").iterdir())) == 3


def test_a_damaged_entry_is_compiled_again(llama_dir, tmp_path, caplog):
    store = tmp_path / "store"
    expected = _run(LLM(str(llama_dir), compilation_cache_dir=str(store), **OPTIONS))
    entries = sorted(store.glob("*/*.bin"))
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="zipage_jax"):
        damaged = LLM(str(llama_dir), compilation_cache_dir=str(store), **OPTIONS)
        assert _run(damaged) == expected
    assert "loaded" not in _origins(damaged)
    assert "could not load the stored" in caplog.text
    rewritten = LLM(str(llama_dir), compilation_cache_dir=str(store), **OPTIONS)
    assert _run(rewritten) == expected
    assert _origins(rewritten).get("loaded", 0) >= len(entries)


def test_no_store_when_the_cache_is_off(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(tmp_path))
    llm = LLM(str(llama_dir), compilation_cache_dir="", **OPTIONS)
    llm.generate(PROMPTS[1], PARAMS, use_tqdm=False)
    assert llm.engine.core.runner.forward.embed.store is None and not (tmp_path / "executables").exists()


def test_host_only_options_are_engine_fields():
    assert executable_store.HOST_ONLY_OPTIONS <= set(EngineConfig.__dataclass_fields__)


def test_source_fingerprint_is_the_imported_source_not_the_files_on_disk_later(monkeypatch):
    imported = executable_store.source_fingerprint()
    assert imported == executable_store._hash_sources()  # nothing edited since import
    monkeypatch.setattr(Path, "read_bytes", lambda self: b"edited while the process runs")
    assert executable_store._hash_sources() != imported
    assert executable_store.source_fingerprint() == imported
