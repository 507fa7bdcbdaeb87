"""Scoring and selection: jnp vs a numpy loop version of the spec, Pallas vs jnp."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from compress_cases import NUM_KV_HEADS, CaseConfig, make_case, score_case, scoring, spec_scores

from pallas_kernels.attention_score import attention_score, attention_score_reference

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

TOL = 1e-5

# (config, query heads per kv head): block sizes 16/32/64, head ratios 1/3/4, QL 4/8/16/32, budgets 1..3
CASES = {
    "attention": (CaseConfig(budget_blocks=1, block_size=16, query_cache_len=4), 1),
    "global_maxnorm_pool_lightning": (CaseConfig(
        budget_blocks=2, block_size=32, query_cache_len=8,
        scoring=scoring(use_global_score=True, max_norm=True, enable_pooling=True, redundancy="lightning")), 3),
    "global_contpool_raw_sinks": (CaseConfig(
        budget_blocks=1, block_size=64, query_cache_len=32, sink_len=3,
        scoring=scoring(use_global_score=True, enable_pooling=True, continues_pooling=True, pooling_size=3,
                        redundancy="raw", redundancy_lambda=0.5)), 4),
    "pool_raw": (CaseConfig(
        budget_blocks=3, block_size=16, query_cache_len=16,
        scoring=scoring(enable_pooling=True, redundancy="raw", redundancy_temperature=1.0,
                        redundancy_threshold=0.3)), 4),
}


def _run(case, cfg):
    return score_case(case, cfg)


def _per_seq(x, b, n):  # [B, Hkv, W, BS] -> [Hkv, n*BS]
    return x[b, :, :n].reshape(NUM_KV_HEADS, -1)


def _assert_keep(keep, final_spec, k):
    """Exactly k kept per head, and every token clearly above / below the k-th score decided right."""
    assert (keep.sum(axis=1) == k).all()
    kth = -np.sort(-final_spec, axis=1)[:, k - 1 : k]
    assert keep[final_spec > kth + TOL].all()
    assert not keep[final_spec < kth - TOL].any()


@pytest.mark.parametrize("name", CASES)
def test_selection_matches_numpy_spec(name):
    cfg, group = CASES[name]
    case = make_case(1, cfg, group)
    stages, score_cache = _run(case, cfg)
    spec = spec_scores(case, cfg)
    for b, n in enumerate(case.num_blocks):
        if n == 0:  # padding row: nothing kept, nothing scored
            assert not stages.keep[b].any()
            assert (stages.final[b] == -np.inf).all()
            continue
        for field in ("attn", "global_score", "pooled", "redundancy"):
            ours, ref = getattr(stages, field), getattr(spec, field)[b]
            if ref is None:
                continue
            np.testing.assert_allclose(_per_seq(ours, b, n), ref, rtol=0, atol=TOL, err_msg=field)
        final = _per_seq(stages.final, b, n)
        np.testing.assert_array_equal(np.isinf(final), np.isinf(spec.final[b]))
        np.testing.assert_allclose(final, spec.final[b], rtol=0, atol=TOL)
        assert (stages.final[b, :, n:] == -np.inf).all() and not stages.keep[b, :, n:].any()
        _assert_keep(_per_seq(stages.keep, b, n), spec.final[b], cfg.budget_tokens)
    if cfg.scoring.use_global_score:  # written back into every valid block, nothing else touched
        np.testing.assert_allclose(np.asarray(score_cache), spec.score_cache, rtol=0, atol=TOL)


@pytest.mark.parametrize("sink_len", [0, 5])
def test_streaming_keeps_sinks_and_recent_tokens(sink_len):
    cfg = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=8, sink_len=sink_len,
                            eviction_policy="streaming")
    case = make_case(2, cfg, 2)
    stages, _ = _run(case, cfg)
    spec = spec_scores(case, cfg)
    for b, n in enumerate(case.num_blocks):
        if n == 0:
            assert not stages.keep[b].any()
            continue
        np.testing.assert_array_equal(_per_seq(stages.keep, b, n), spec.keep[b])
        assert not stages.keep[b, :, n:].any()


@pytest.mark.parametrize("name", CASES)
def test_attention_score_pallas_matches_jnp(name):
    cfg, group = CASES[name]
    case = make_case(3, cfg, group)
    args = (jnp.asarray(case.k_pool), jnp.asarray(case.query_cache[case.query_ids]),
            jnp.asarray(case.block_tables), jnp.asarray(case.num_blocks))
    ours = np.asarray(attention_score(*args, interpret=True))
    ref = np.asarray(attention_score_reference(*args))
    assert np.isfinite(ours).all()  # NaN in the dummy and unused blocks never leaks
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    w = np.arange(case.block_tables.shape[1])
    padding = w[None, :] >= case.num_blocks[:, None]  # [B, W]
    assert (ours.transpose(0, 2, 1, 3)[padding] == 0).all()  # padding blocks and rows are 0


def test_bad_inputs_raise():
    cfg, group = CASES["attention"]
    case = make_case(4, cfg, group)
    k_pool, queries = jnp.asarray(case.k_pool), jnp.asarray(case.query_cache[case.query_ids])
    tables, num_blocks = jnp.asarray(case.block_tables), jnp.asarray(case.num_blocks)
    with pytest.raises(ValueError, match="multiple"):
        attention_score_reference(k_pool, queries[:, :, :1].repeat(3, axis=2), tables, num_blocks)
    with pytest.raises(ValueError, match="int32"):
        attention_score_reference(k_pool, queries, tables.astype(jnp.int16), num_blocks)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        attention_score(k_pool[..., :8], queries[..., :8], tables, num_blocks, interpret=True)
