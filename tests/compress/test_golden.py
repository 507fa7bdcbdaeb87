"""Our scoring and compaction vs golden vectors captured from the reference engine."""

import argparse
import json
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention_score import attention_score
from zipage_jax.backend import Backend
from zipage_jax.crosscheck import golden

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

FILES = sorted((Path(__file__).parent / "data" / "golden").glob("*.npz"))


def test_golden_files_present():
    assert [f.stem for f in FILES] == ["base", "global", "lightning", "mha", "pooling", "raw_redundancy"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_xla_pipeline_matches_reference(path):
    report = golden.check_file(path, "xla")
    assert report["ok"], report
    assert all(err <= golden.SCORE_TOL for err in report["stages"].values())
    if path.stem == "pooling":  # max pooling makes plateaus: the reference broke k-th score ties its own way
        assert report["keep_mismatches"] > 0 and report["keep_mismatches_not_ties"] == 0
    else:
        assert report["keep_mismatches"] == 0 and all(report["pools_bit_identical"].values())


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_pallas_kernels_match_reference(path):
    """Each kernel on the reference's own inputs: attention score, then compaction of its keep."""
    z, cfg, tables, num_blocks, rows = golden.load_case(path)
    for layer in range(z["k_cache_in"].shape[0]):
        queries = jnp.asarray(z["query_cache"][layer][z["query_ids"]])
        attn = attention_score(jnp.asarray(z["k_cache_in"][layer]), queries, jnp.asarray(tables),
                               jnp.asarray(num_blocks), interpret=True)
        assert np.abs(np.asarray(attn) - z["attn_score"][layer]).max() <= golden.SCORE_TOL
        budget_blocks = int(rows.budget.max()) // z["k_cache_in"].shape[2]  # [L, NB, BS, Hkv, D]
        pools = golden.compact_on_reference_keep(z, layer, cfg, tables, budget_blocks, Backend.PALLAS_INTERPRET)
        for name, pool in zip(("k_cache_out", "v_cache_out", "score_cache_out"), pools):
            assert (pool is None) == (name not in z)
            assert pool is None or np.asarray(pool).tobytes() == z[name][layer].tobytes(), name


def test_cli_json_and_exit_code(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    golden.add_arguments(parser)
    assert golden.run(parser.parse_args([str(FILES[0]), "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["file"] == str(FILES[0]) and report["ok"] is True

    broken = dict(np.load(FILES[0]))
    broken["k_cache_out"] = broken["k_cache_out"].copy()
    broken["k_cache_out"][0, 3, 0, 0, 0] += 1  # block 3 is a target: one wrong key
    path = tmp_path / "broken.npz"
    np.savez(path, **broken)
    assert golden.run(parser.parse_args([str(path)])) == 1
    assert "MISMATCH" in capsys.readouterr().out
