"""The automatic budget's measurement (scoring.py evicted_mass) against a numpy twin, and its
choice of the next budget (compress/auto_budget.py choose)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from compress_cases import CaseConfig, compress_args, make_case, scoring

from zipage_jax.compress.auto_budget import bounds, choose
from zipage_jax.compress.scoring import evicted_mass
from zipage_jax.compress.step import compress


def _twin(final: np.ndarray, attn: np.ndarray, num_blocks: np.ndarray) -> np.ndarray:
    """Per row, head and j: rank the tokens by final (ties by index), keep the first j * BS, and
    sum the attention of the others over the whole attention; mean over heads."""
    batch, heads, width, bs = final.shape
    out = np.zeros((batch, width))
    for b in range(batch):
        for j in range(width):
            if j >= num_blocks[b]:
                continue
            lost = []
            for h in range(heads):
                f, a = final[b, h].ravel(), attn[b, h].ravel()
                order = sorted(range(len(f)), key=lambda t: (-f[t], t))
                kept = set(order[:j * bs])
                total = a.sum()
                lost.append(0.0 if total == 0 else sum(a[t] for t in range(len(a)) if t not in kept) / total)
            out[b, j] = np.mean(lost)
    return out


def test_evicted_mass_matches_the_twin():
    rng = np.random.default_rng(0)
    batch, heads, width, bs = 3, 2, 4, 4
    num_blocks = np.array([4, 2, 0])
    attn = rng.random((batch, heads, width, bs)).astype(np.float32)
    final = rng.normal(size=attn.shape).astype(np.float32)
    valid = np.arange(width)[None, None, :, None] < num_blocks[:, None, None, None]
    attn = np.where(valid, attn, 0.0).astype(np.float32)
    final = np.where(valid, final, -np.inf).astype(np.float32)
    final[0, :, 0, :2] = np.inf  # protected tokens rank first
    got = np.asarray(evicted_mass(jnp.asarray(final), jnp.asarray(attn), jnp.asarray(num_blocks, jnp.int32)))
    np.testing.assert_allclose(got, _twin(final, attn, num_blocks), atol=1e-5)
    assert np.all(got[:2, 0] == pytest.approx(1.0)) and np.all(got[2] == 0)
    assert np.all(np.diff(got[0]) <= 1e-6)  # keeping more never loses more


def test_evicted_mass_follows_the_ranking_not_the_attention():
    """The policy ranks by its final score: attention on tokens it ranks low is what is lost."""
    attn = np.zeros((1, 1, 2, 2), np.float32)
    attn[0, 0, 1, 1] = 1.0  # all attention on the last token
    final = np.array([[[[4.0, 3.0], [2.0, 1.0]]]], np.float32)  # ranked last
    got = np.asarray(evicted_mass(jnp.asarray(final), jnp.asarray(attn), jnp.asarray([2], jnp.int32)))
    assert got.tolist() == [[1.0, 1.0]]  # keeping one block of two loses it all


def test_a_measurement_leaves_the_caches_as_they_were():
    """A row whose budget holds every token it has (an automatic budget's measurement, written in
    place) keeps its K/V, global scores and positions as they were; the same rows compacting to
    their budget (the positive control) write both caches."""
    cfg = CaseConfig(budget_blocks=2, block_size=8, query_cache_len=4, scoring=scoring(use_global_score=True))
    case = make_case(3, cfg, group=2)
    pools, queries, tables, num_blocks, query_ids, compressed, targets, rows, compression = compress_args(case, cfg)
    sentinel = jnp.full(pools[0].scores.shape, -7, jnp.int32)  # no position is negative
    pools = [pools[0]._replace(positions=sentinel)]
    held = np.asarray(case.num_blocks) * cfg.block_size
    valid = np.concatenate([np.asarray(case.block_tables)[b, :n] for b, n in enumerate(case.num_blocks)])

    def run(budget, target_tables):
        out = compress(pools, queries, tables, num_blocks, query_ids, compressed,
                       target_tables, rows._replace(budget=budget), compression)[0]
        return {name: np.asarray(getattr(out, name))[valid] for name in ("k", "v", "scores", "positions")}

    before = {name: np.asarray(getattr(pools[0], name))[valid] for name in ("k", "v", "scores", "positions")}
    measured = run(held.astype(np.int32), tables)
    for name in before:
        np.testing.assert_array_equal(measured[name], before[name], err_msg=name)
    compacted = run(rows.budget, targets)
    assert not np.array_equal(compacted["scores"], before["scores"])
    assert (compacted["positions"] != -7).any()


def _choose(losses, num_blocks, budget, floor=1, ceiling=10, grow=2, threshold=0.05, free=100):
    n = len(losses)
    full = lambda x: np.full(n, x)  # noqa: E731
    return choose(np.asarray(losses, float), np.asarray(num_blocks), np.asarray(budget), full(floor), full(ceiling),
                  full(grow), full(threshold), free)


def test_choose_keeps_the_fewest_blocks_that_lose_little_enough():
    losses = [[1.0, 0.5, 0.04, 0.01, 0.0, 0.0]]  # a row holding 5 blocks at a budget of 4
    blocks, compacts = _choose(losses, [5], [4])
    assert (blocks.tolist(), compacts.tolist()) == ([2], [True])  # shrinks: 2 blocks lose 4%
    blocks, compacts = _choose(losses, [5], [4], floor=3)
    assert (blocks.tolist(), compacts.tolist()) == ([3], [True])  # never below the floor
    blocks, compacts = _choose(losses, [5], [4], threshold=0.005)
    assert (blocks.tolist(), compacts.tolist()) == ([4], [True])  # 4 = what it holds but one


def test_choose_grows_when_every_budget_loses_too_much():
    losses = [[1.0, 0.5, 0.3, 0.2, 0.1, 0.0]]
    blocks, compacts = _choose(losses, [5], [4])
    assert (blocks.tolist(), compacts.tolist()) == ([6], [False])  # grows by 2, measures again when full
    blocks, compacts = _choose(losses, [5], [4], ceiling=5)
    assert (blocks.tolist(), compacts.tolist()) == ([5], [False])  # up to its ceiling
    blocks, compacts = _choose(losses, [5], [4], ceiling=4)
    assert (blocks.tolist(), compacts.tolist()) == ([4], [True])  # at its ceiling: compacts to it
    blocks, compacts = _choose(losses, [7], [6], ceiling=4)
    assert (blocks.tolist(), compacts.tolist()) == ([4], [True])  # holding more than its ceiling (a long prompt)


def test_choose_grows_only_into_free_blocks():
    losses = [[1.0, 0.5, 0.3, 0.2, 0.1, 0.0]] * 3
    blocks, compacts = _choose(losses, [5, 5, 5], [4, 4, 4], free=2)
    assert blocks.tolist() == [6, 6, 4] and compacts.tolist() == [False, False, True]  # the third takes none
    blocks, compacts = _choose(losses, [5, 5, 5], [4, 4, 4], free=0)
    assert blocks.tolist() == [4, 4, 4] and all(compacts)


def test_bounds_round_to_blocks_and_hold_what_the_policy_protects():
    auto = bounds(64, 1000, 64, 0.05, 16, lambda blocks: True)
    assert (auto.floor, auto.ceiling, auto.grow, auto.threshold) == (4, 62, 4, 0.05)
    auto = bounds(10, 20, 10, 0.1, 16, lambda blocks: blocks >= 3)
    assert (auto.floor, auto.ceiling, auto.grow) == (3, 3, 1)  # the floor rises to 3; the ceiling with it
