"""Token positions through compaction, and the prompt reserve, against numpy versions of their rules."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from compress_cases import NUM_KV_HEADS, CaseConfig, compress_args, make_case, scoring

from pallas_kernels.kv_pool import KVPool
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import (
    POLICIES,
    Policy,
    PolicyOptions,
    RowSequence,
    Score,
    compress_rows,
    resolve_budget,
)
from zipage_jax.compress.scoring import global_score, prompt_reserve, token_positions
from zipage_jax.compress.step import compress_layer

BS = 16


def _rows(budget_tokens: int, prompt_lens, offsets, reserve: int, sinks: int = 0):
    policy = Policy("test", Score.ATTENTION, PolicyOptions(sinks=sinks, prompt_fraction=0.5))
    budget = resolve_budget(policy, policy.defaults, budget_tokens // BS, BS, 4)
    budget = type(budget)(policy, budget.blocks, budget.tokens, sinks, budget.recent, reserve)
    return compress_rows([budget] * len(prompt_lens), None,
                         [RowSequence(p, o) for p, o in zip(prompt_lens, offsets)])


def test_token_positions_read_history_and_number_fresh_slots():
    # row 0 never compressed (slot = position); row 1 compressed with a 2-block budget: its first
    # two blocks' positions come from the cache, the third block's from the offset (40 evicted)
    num_blocks_pool = 8
    cache = np.full((num_blocks_pool, BS, NUM_KV_HEADS), -7, np.int32)
    rng = np.random.default_rng(0)
    history = np.stack([np.sort(rng.choice(60, 2 * BS, replace=False)) for _ in range(NUM_KV_HEADS)])
    cache[[5, 2]] = history.T.reshape(2, BS, NUM_KV_HEADS)
    tables = np.array([[1, 3, 4], [5, 2, 6]], np.int32)
    rows = _rows(2 * BS, [10, 10], [0, 40], reserve=0)
    positions, new_cache = token_positions(jnp.asarray(cache), jnp.asarray(tables), jnp.asarray([3, 3]),
                                           jnp.asarray([False, True]), rows, NUM_KV_HEADS, BS)
    positions, new_cache = np.asarray(positions), np.asarray(new_cache)
    np.testing.assert_array_equal(positions[0].reshape(NUM_KV_HEADS, -1), np.tile(np.arange(3 * BS), (2, 1)))
    expected = np.concatenate([history, np.tile(40 + np.arange(2 * BS, 3 * BS), (2, 1))], axis=1)
    np.testing.assert_array_equal(positions[1].reshape(NUM_KV_HEADS, -1), expected)
    for b in range(2):  # written back into the sequences' blocks, nowhere else
        np.testing.assert_array_equal(new_cache[tables[b]].transpose(2, 0, 1), positions[b])
    untouched = [i for i in range(num_blocks_pool) if i not in tables]
    assert (new_cache[untouched] == -7).all()


def test_after_a_budget_grew_only_the_blocks_it_kept_are_history():
    """An automatic budget kept 1 block at its last compaction and has grown to 2 since: its
    first block's position and global score come from the caches, the two blocks written since
    are numbered from the offset and scored afresh (their caches hold another sequence's)."""
    cache = np.full((8, BS, NUM_KV_HEADS), 500, np.int32)  # stale: no real position here
    cache[5] = np.arange(BS)[:, None] + 3  # the block it kept
    tables = np.array([[5, 2, 6]], np.int32)
    rows = _rows(2 * BS, [10], [30], reserve=0)._replace(history=np.array([1], np.int32))
    args = (jnp.asarray(tables), jnp.asarray([3]), jnp.asarray([True]))
    positions = np.asarray(token_positions(jnp.asarray(cache), *args, rows, NUM_KV_HEADS, BS)[0])
    expected = np.concatenate([np.arange(BS) + 3, 30 + np.arange(BS, 3 * BS)])
    np.testing.assert_array_equal(positions[0].reshape(NUM_KV_HEADS, -1), np.tile(expected, (2, 1)))
    fresh = np.random.default_rng(2).random((1, NUM_KV_HEADS, 3, BS)).astype(np.float32)
    score_cache = np.full((8, BS, NUM_KV_HEADS), 9.0, np.float32)
    scored, _ = global_score(jnp.asarray(fresh), jnp.asarray(score_cache), *args, rows,
                             CompressionConfig(decay_factor=0.5))
    expected = fresh.copy()
    expected[:, :, 0] = 4.5  # max(fresh < 1, 0.5 * 9) in the kept block alone
    np.testing.assert_allclose(np.asarray(scored), expected)


def test_prompt_reserve_keeps_the_best_prompt_tokens_sinks_first():
    rng = np.random.default_rng(1)
    batch, width = 3, 4
    scores = rng.random((batch, NUM_KV_HEADS, width, BS)).astype(np.float32)
    positions = np.tile(np.arange(width * BS).reshape(width, BS), (batch, NUM_KV_HEADS, 1, 1)) + 3
    valid = np.ones((batch, 1, width, BS), bool)
    valid[2, :, 3:] = False
    prompt_lens, reserve, sinks = [20, 50, 60], 12, 2
    rows = _rows(4 * BS, prompt_lens, [0, 0, 0], reserve, sinks)
    got = np.asarray(prompt_reserve(jnp.asarray(scores), jnp.asarray(positions), jnp.asarray(valid), rows))
    for b in range(batch):
        for h in range(NUM_KV_HEADS):
            s, p, v = scores[b, h].ravel(), positions[b, h].ravel(), valid[b, 0].ravel()
            prompt = np.nonzero(v & (p < prompt_lens[b]))[0]
            ranked = sorted(prompt, key=lambda i: (i >= sinks, -s[i]))
            expected = np.zeros_like(v)
            expected[ranked[:reserve]] = True
            np.testing.assert_array_equal(got[b, h].ravel(), expected, err_msg=f"row {b} head {h}")


@pytest.mark.parametrize("prompt_len", [5, 40, 100])
def test_compaction_keeps_the_reserve_and_moves_positions(prompt_len):
    """A reserve larger than any head would keep by score: each head keeps min(prompt, reserve)
    prompt tokens, and the position cache holds the kept tokens' positions in order."""
    cfg = CaseConfig(budget_blocks=3, block_size=BS, query_cache_len=8, sink_len=4, eviction_policy="window",
                     recent_fraction=0.25, scoring=scoring(use_global_score=True))
    case = make_case(3, cfg, group=2, compressed=(False, False, False))
    pools, queries, tables, num_blocks, query_ids, compressed, targets, _, score_cfg = compress_args(case, cfg)
    policy = Policy("reserve", Score.ATTENTION, PolicyOptions(sinks=4, recent_fraction=0.25, prompt_fraction=0.5))
    budget = resolve_budget(policy, policy.defaults, cfg.budget_blocks, BS, cfg.query_cache_len)
    assert budget.prompt_reserve == 24 and budget.recent == 12
    live = np.asarray(num_blocks) > 0
    rows = compress_rows([budget if n else None for n in live], None,
                         [RowSequence(prompt_len, 0) for _ in live])
    pool = pools[0]._replace(positions=jnp.full(pool_shape(pools[0]), -1, jnp.int32))
    out, stages = compress_layer(pool, queries[0], tables, num_blocks, query_ids, compressed, targets, rows, score_cfg)
    keep, out_positions = np.asarray(stages.keep), np.asarray(out.positions)
    for b in np.nonzero(live)[0]:
        for h in range(NUM_KV_HEADS):
            kept = np.nonzero(keep[b, h].ravel())[0]  # never compressed: slot = position
            assert len(kept) == budget.tokens
            assert (kept < prompt_len).sum() >= min(prompt_len, budget.prompt_reserve)
            moved = out_positions[np.asarray(targets)[b, :cfg.budget_blocks], :, h].ravel()
            np.testing.assert_array_equal(moved, kept)


def pool_shape(pool: KVPool) -> tuple[int, ...]:
    return pool.k.shape[:3]


def test_reserve_is_validated_and_overridable():
    policy = Policy("reserve", Score.VALUE_NORM, PolicyOptions(sinks=4, recent_fraction=0.5, prompt_fraction=0.5))
    with pytest.raises(ValueError, match="sinks, recent window and prompt reserve"):
        resolve_budget(policy, policy.options(prompt_fraction=0.75), 2, BS, 4)
    assert resolve_budget(policy, policy.options(prompt_fraction=0.25), 4, BS, 4).prompt_reserve == 16
    assert POLICIES["window"].options(prompt_fraction=0.5).prompt_fraction == 0.0  # no reserve to override


def test_a_reserve_the_prompt_cannot_fill_goes_to_the_recent_window():
    policy = POLICIES["vnorm-prompt"]
    budget = resolve_budget(policy, policy.defaults, 8, BS, 16)  # 128 tokens: reserve 64, recent 32
    assert (budget.prompt_reserve, budget.recent, budget.sinks) == (64, 32, 4)
    rows = compress_rows([budget] * 4, None, [RowSequence(p, 0) for p in (200, 64, 10, 2)])
    np.testing.assert_array_equal(rows.recent, [32, 32, 32 + 54, 32 + 60])  # never below the sinks
    np.testing.assert_array_equal(rows.prompt_reserve, [64] * 4)
    assert (np.minimum(rows.prompt_reserve, np.maximum(rows.prompt_len, 4)) + rows.recent <= budget.tokens).all()
