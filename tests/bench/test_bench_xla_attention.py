"""`zipage-jax bench xla-attention`: the XLA decode attention timed at every step size (tiny cases)."""

from __future__ import annotations

import pytest

from zipage_jax.bench import xla_attention


def test_bench_xla_attention_times_every_step_and_marks_the_default(bench_args, last_json):
    args = bench_args("xla-attention", "--cases", "2x40", "1x70", "--steps", "32", "128", "--runs", "2", "--json")
    assert xla_attention.run(args) == 0
    out = last_json()["cases"]
    assert [(c["batch"], c["context"]) for c in out] == [(2, 40), (1, 70)]
    assert [c["default_step"] for c in out] == [128, 256]  # tokens_per_step: 256 keys for one row, 128 for more
    assert all(set(c["ms"]) == {"32", "128"} and min(c["ms"].values()) > 0 for c in out)
    for bad in (["--cases", "2by40"], ["--cases", "0x40"], ["--steps", "48"]):
        with pytest.raises(SystemExit):
            xla_attention.run(bench_args("xla-attention", *bad))
