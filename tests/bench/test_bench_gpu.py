"""`zipage-jax bench gpu`: its sections on the CPU (--smoke: tiny shapes, the Pallas interpreter),
the time limits, the random model it builds, and scripts/bench_gpu.py, its launcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zipage_jax.bench import gpu
from zipage_jax.bench.compact_cases import PATTERNS
from zipage_jax.models.random_model import QWEN3_8B, TINY_QWEN3, random_model

ROOT = Path(__file__).resolve().parents[2]


def test_deadline_interrupts_a_section():
    with pytest.raises(gpu.SectionTimeout):
        with gpu.deadline(0.05):
            while True:
                pass
    with pytest.raises(gpu.SectionTimeout, match="no time left"):
        with gpu.deadline(0):
            pass


def _sections(out: str) -> tuple[list[str], dict]:
    """The sections' own JSON lines (in order) and the final report."""
    lines = [json.loads(line) for line in out.strip().splitlines()]
    return [line["section"] for line in lines[:-1]], lines[-1]


def test_bench_gpu_smoke_compaction(bench_args, capsys):
    skip = [name for name in gpu.SECTIONS if name not in ("environment", "compact")]
    assert gpu.run(bench_args("gpu", "--smoke", "--seeds", "3", "--skip", *skip)) == 0
    printed, report = _sections(capsys.readouterr().out)
    assert printed == ["environment", "compact"] and report["ok"]
    (config,) = report["sections"]["compact"]["configs"]
    assert config["cases"] == len(PATTERNS) + 3 and config["failed"] == []


@pytest.mark.slow
def test_bench_gpu_smoke_every_section(llama_dir, bench_args, capsys):
    assert gpu.run(bench_args("gpu", "--smoke", "--model", llama_dir)) == 0
    printed, report = _sections(capsys.readouterr().out)
    sections = report["sections"]
    assert printed == list(gpu.SECTIONS) == list(sections)
    assert report["ok"], {k: v.get("error") for k, v in sections.items()}
    assert sections["paged_decode"]["cases"][0]["max_abs_err"] < 1e-4
    assert sections["attention_score"]["cases"][0]["max_abs_err"] < 1e-6
    assert sections["decode_bandwidth"]["cases"][0]["achieved_gbs"] > 0
    assert {"compact_pallas_ms_per_layer", "compress_step_xla_ms_per_layer"} <= set(
        sections["compaction_time"]["cases"][0])
    for name in ("engine_default", "engine_qwen3_8b"):
        engine = sections[name]
        assert engine["zipage"]["compressions"] > 0 and engine["full"]["compressions"] == 0, name
        assert engine["pool_blocks"] == 3 * (1 + 1) + 1, name  # one pool for both runs: M + 1 blocks each
        assert engine["full"]["output_tokens"] == engine["zipage"]["output_tokens"] == 3 * 40, name
    assert sections["engine_qwen3_8b"]["model_config"]["num_layers"] == 2


def test_bench_gpu_random_model_and_byte_tokenizer():
    loaded = random_model(TINY_QWEN3, "float32", num_layers=1)
    assert loaded.config.num_layers == 1 and loaded.config.num_kv_heads == 2 and loaded.config.qk_norm
    tok = loaded.tokenizer
    ids = tok("héllo")["input_ids"]
    assert ids == list("héllo".encode()) and max(ids) < loaded.config.vocab_size
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens([7, 300])) == "<7><300>"
    from zipage_jax import SamplingParams
    from zipage_jax.engine.llm_engine import LLMEngine

    engine = LLMEngine(loaded=loaded, num_kvcache_blocks=4, kvcache_block_size=16, max_num_seqs=1)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # ids below len(tok)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request([256], SamplingParams(max_tokens=1))
    outs = [o for _ in range(8) for o in engine.step() if o.finished]
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    assert QWEN3_8B["num_layers"] == 36 and QWEN3_8B["vocab_size"] == 151936


def test_bench_gpu_sizes_default_per_mode_and_flags_win(bench_args):
    on_gpu = bench_args("gpu")
    gpu.fill_sizes(on_gpu)
    assert (on_gpu.engine_requests, on_gpu.decode_batch, on_gpu.decode_context) == (64, 64, 4096)
    smoke = bench_args("gpu", "--smoke", "--engine-requests", "5")
    gpu.fill_sizes(smoke)
    assert smoke.engine_requests == 5 and smoke.decode_batch == gpu.SIZES["smoke"]["decode_batch"]


def test_bench_gpu_reports_a_failing_section_and_runs_the_next(bench_args, capsys, monkeypatch):
    def broken(args):
        raise RuntimeError("no such kernel")

    args = bench_args("gpu", "--smoke")  # parsed before SECTIONS changes: --skip's choices come from it
    monkeypatch.setattr(gpu, "SECTIONS", {"bad": broken, "environment": gpu.section_environment})
    assert gpu.run(args) == 1
    printed, report = _sections(capsys.readouterr().out)
    assert printed == ["bad", "environment"]
    assert not report["ok"] and "no such kernel" in report["sections"]["bad"]["error"]
    assert report["sections"]["environment"]["backend"] == "cpu"


def test_the_launcher_runs_bench_gpu():
    """scripts/bench_gpu.py, as the project guide runs it on a GPU machine: `zipage-jax bench gpu`."""
    skip = [name for name in gpu.SECTIONS if name != "environment"]
    done = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--smoke", "--skip", *skip], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed, report = _sections(done.stdout)
    assert printed == ["environment"] and report["ok"] and report["sections"]["environment"]["smoke"]
