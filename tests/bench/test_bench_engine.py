"""`zipage-jax bench engine`: this engine's tokens/s against transformers and its decode step
against the matrix products alone (a tiny model)."""

from __future__ import annotations

import pytest

from zipage_jax.bench import engine


@pytest.mark.slow
def test_bench_engine_against_hf_and_the_matmul_floor(llama_dir, bench_args, last_json):
    args = bench_args("engine", "--model", llama_dir, "--batches", "1", "2", "--new-tokens", "6", "--runs", "2",
                      "--json")
    assert engine.run(args) == 0
    out = last_json()
    assert out["new_tokens"] == 6 and set(out["batches"]) == {"1", "2"}
    for row in out["batches"].values():
        assert row["zipage_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio_vs_hf"] == pytest.approx(row["zipage_tok_s"] / row["hf_tok_s"])
        assert 0 < row["matmul_floor_ms"] and row["decode_step_ms"] > 0
        assert row["decode_step_over_floor"] == pytest.approx(row["decode_step_ms"] / row["matmul_floor_ms"])
