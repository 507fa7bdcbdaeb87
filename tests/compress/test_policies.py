"""Eviction policies beyond the reference (zipage_jax/compress/policies.py): jnp vs numpy."""

import dataclasses

import jax
import numpy as np
import pytest
from compress_cases import (
    HEAD_DIM,
    NUM_KV_HEADS,
    CaseConfig,
    compress_args,
    make_case,
    score_case,
    scoring,
    spec_scores,
)

from zipage_jax.compress.step import compress
from zipage_jax.config import EngineConfig

TOL = 1e-5

CASES = {  # (config, query heads per kv head)
    "window": (CaseConfig(budget_blocks=2, block_size=16, query_cache_len=4, eviction_policy="window"), 2),
    "window_global_pool_sinks": (CaseConfig(
        budget_blocks=3, block_size=16, query_cache_len=8, sink_len=2, recent_fraction=0.25, eviction_policy="window",
        scoring=scoring(use_global_score=True, enable_pooling=True)), 3),
    "window_lightning": (CaseConfig(
        budget_blocks=2, block_size=32, query_cache_len=8, recent_fraction=0.0, eviction_policy="window",
        scoring=scoring(redundancy="lightning")), 1),
    "vnorm_window": (CaseConfig(
        budget_blocks=2, block_size=16, query_cache_len=8, recent_fraction=0.3, eviction_policy="vnorm-window"), 2),
    "rkv": (CaseConfig(
        budget_blocks=2, block_size=16, query_cache_len=8, recent_fraction=0.25, eviction_policy="rkv"), 2),
    "rkv_global": (CaseConfig(budget_blocks=3, block_size=16, query_cache_len=4, recent_fraction=0.5,
                              eviction_policy="rkv", scoring=scoring(use_global_score=True)), 1),
    "triattention": (CaseConfig(
        budget_blocks=2, block_size=16, query_cache_len=8, recent_fraction=0.25, eviction_policy="triattention"), 2),
    "triattention_gqa3": (CaseConfig(
        budget_blocks=3, block_size=16, query_cache_len=4, recent_fraction=0.5, eviction_policy="triattention"), 3),
}


def _numpy_rkv(attn: np.ndarray, redundancy: np.ndarray) -> np.ndarray:
    """R-KV's score from its paper: lambda * importance - (1 - lambda) * redundancy, importance
    normalised to a distribution over the tokens, lambda = 0.1. attn, redundancy: [Hkv, T]."""
    return 0.1 * attn / attn.sum(axis=1, keepdims=True) - 0.9 * redundancy


def _numpy_future(case, cfg, b, n) -> np.ndarray:
    """Predicted attention of future queries [Hkv, T], derived with absolute positions: every
    cached query is un-rotated to its pre-RoPE vector (query i at position T - QL + i), the
    centre is their mean, and a query at position T - 1 + d is the centre rotated to it."""
    t_len, ql = n * cfg.block_size, cfg.query_cache_len
    keys = case.k_pool[case.block_tables[b, :n]].astype(np.float64).reshape(t_len, NUM_KV_HEADS, HEAD_DIM)
    queries = case.query_cache[case.query_ids[b]].astype(np.float64)  # [QL, Hq, D]
    group = queries.shape[1] // NUM_KV_HEADS
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    half = HEAD_DIM // 2

    def rotation(position):  # [D, D]: RoPE at `position`, rotate_half layout
        r = np.zeros((HEAD_DIM, HEAD_DIM))
        for f, w in enumerate(inv_freq):
            c, s = np.cos(position * w), np.sin(position * w)
            r[f, f], r[f, f + half], r[f + half, f], r[f + half, f + half] = c, -s, s, c
        return r

    def pairs(x):
        return np.hypot(x[..., :half], x[..., half:])

    score = np.zeros((NUM_KV_HEADS, t_len))
    for h in range(NUM_KV_HEADS):
        best = np.zeros((13, t_len))
        for g in range(group):
            q = queries[:, h * group + g]  # [QL, D]
            pre = np.stack([rotation(-(t_len - ql + i)) @ q[i] for i in range(ql)])
            centre = pre.mean(axis=0)
            spread = pairs(q).mean(axis=0) - pairs(centre)
            for m in range(13):
                future = rotation(t_len - 1 + 2**m) @ centre
                s = (keys[:, h] @ future + pairs(keys[:, h]) @ spread) * HEAD_DIM**-0.5
                p = np.exp(s - s.max())
                best[m] = np.maximum(best[m], p / p.sum())
        score[h] = best.mean(axis=0)
    return score


def _numpy_policy(case, cfg, b, n):
    """The policy one sequence at a time: the reference stages from the numpy spec, value norms,
    then sinks and the recent window. Returns (final, keep), each [Hkv, T]."""
    reference = dataclasses.replace(cfg, eviction_policy="zipage", sink_len=0)
    blocks = case.block_tables[b, :n]
    t_len = n * cfg.block_size
    if cfg.eviction_policy == "triattention":
        assert not cfg.scoring.use_global_score
        score = _numpy_future(case, cfg, b, n)
    elif cfg.eviction_policy == "rkv":
        spec = spec_scores(case, reference)
        red = spec_scores(case, dataclasses.replace(reference, scoring=dataclasses.replace(
            cfg.scoring, redundancy="raw"))).redundancy[b]
        score = _numpy_rkv(next(s[b] for s in (spec.global_score, spec.attn) if s[b] is not None), red)
    elif cfg.eviction_policy == "vnorm-window":
        # the weighting comes before every other stage: only the attention-only pipeline is checked
        assert not (cfg.scoring.use_global_score or cfg.scoring.enable_pooling or cfg.scoring.redundancy != "none")
        values = case.v_pool[blocks].astype(np.float64).reshape(t_len, NUM_KV_HEADS, -1)
        score = spec_scores(case, reference).attn[b] * np.linalg.norm(values, axis=-1).T
    else:
        spec = spec_scores(case, reference)
        score = next(s[b] for s in (spec.pooled, spec.global_score, spec.attn) if s[b] is not None).copy()
        if cfg.scoring.redundancy != "none":
            score = score * cfg.scoring.redundancy_lambda - spec.redundancy[b] * (1 - cfg.scoring.redundancy_lambda)
    sinks = cfg.sink_len or 4
    recent = max(cfg.query_cache_len, int(cfg.recent_fraction * cfg.budget_tokens))
    pos = np.arange(t_len)
    final = np.where((pos < sinks) | (pos >= t_len - recent), np.inf, score)
    keep = np.zeros_like(final, bool)
    for h in range(NUM_KV_HEADS):
        keep[h, np.argsort(-final[h], kind="stable")[: cfg.budget_tokens]] = True
    return final, keep


@pytest.mark.parametrize("name", CASES)
def test_policy_matches_numpy(name):
    cfg, group = CASES[name]
    case = make_case(5, cfg, group)
    stages, _ = score_case(case, cfg)
    final_all, keep_all = np.asarray(stages.final), np.asarray(stages.keep)
    for b, n in enumerate(case.num_blocks):
        if n == 0:
            assert not keep_all[b].any() and (final_all[b] == -np.inf).all()
            continue
        final = final_all[b, :, :n].reshape(NUM_KV_HEADS, -1)
        keep = keep_all[b, :, :n].reshape(NUM_KV_HEADS, -1)
        ref_final, ref_keep = _numpy_policy(case, cfg, b, int(n))
        np.testing.assert_array_equal(np.isinf(final), np.isinf(ref_final))
        np.testing.assert_allclose(final, ref_final, rtol=0, atol=TOL)
        assert (keep.sum(axis=1) == cfg.budget_tokens).all()
        np.testing.assert_array_equal(keep, ref_keep)  # random scores: no ties
        assert not keep_all[b, :, n:].any()


def test_window_keeps_the_recent_share_of_the_budget():
    cfg, group = CASES["window"]
    cfg = dataclasses.replace(cfg, recent_fraction=0.5)
    case = make_case(6, cfg, group)
    stages, _ = score_case(case, cfg)
    for b, n in enumerate(case.num_blocks[case.num_blocks > 0]):
        keep = np.asarray(stages.keep)[b, :, :n].reshape(NUM_KV_HEADS, -1)
        assert keep[:, :4].all() and keep[:, -cfg.budget_tokens // 2:].all()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["window", "vnorm-window", "rkv", "triattention"])
def test_compress_pallas_matches_xla(policy):
    cfg = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=4, eviction_policy=policy,
                     scoring=scoring(use_global_score=True, enable_pooling=True))
    case = make_case(7, cfg, 2)
    args = compress_args(case, cfg)
    xla = compress(*args, backend="xla")
    pallas = compress(*args, backend="pallas-interpret")
    for a, b in zip(jax.tree.leaves(xla), jax.tree.leaves(pallas)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_mixed_policies_and_budgets_in_one_batch_match_each_alone():
    # one compiled step: every row keeps what a batch of its own policy and budget keeps
    base = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=4, scoring=scoring(use_global_score=True))
    case = make_case(9, base, 2, extra_blocks=(0, 1, 2, 2, 1, 0), compressed=(False, True, False, True, True, False))
    settings = [("zipage", 2), ("window", 1), ("vnorm-window", 2), ("streaming", 3), ("rkv", 2), ("triattention", 2)]
    alone = []
    for b, (policy, budget) in enumerate(settings):
        cfg = dataclasses.replace(base, eviction_policy=policy, budget_blocks=budget)
        alone.append(score_case(case, cfg)[0].keep[b])
    rows = [dataclasses.replace(base, eviction_policy=p, budget_blocks=m).rows(case.num_blocks[b:b + 1])
            for b, (p, m) in enumerate(settings)]
    mixed_rows = type(rows[0])(*(np.concatenate([getattr(r, f) for r in rows] + [np.zeros(1, np.int32)])
                                 for f in rows[0]._fields))
    stages, _ = score_case(case, base, rows=mixed_rows)
    for b, keep in enumerate(alone):
        np.testing.assert_array_equal(stages.keep[b], keep)
        assert stages.keep[b].reshape(NUM_KV_HEADS, -1).sum(axis=1).tolist() == [settings[b][1] * 16] * NUM_KV_HEADS


@pytest.mark.parametrize("options, message", [
    (dict(eviction_policy="h2o"), "eviction_policy"),
    (dict(recent_fraction=1.0), "recent_fraction"),
    (dict(recent_fraction=-0.1), "recent_fraction"),
])
def test_bad_policy_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kvcache_block_size=16, **options)
