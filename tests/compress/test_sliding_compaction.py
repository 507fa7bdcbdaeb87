"""Compaction of sliding-window layers: a sliding layer keeps each sequence's most recent
`budget` tokens, in order, whatever its policy; a full-attention layer is unchanged; the window
reaches the runner's one compaction program as data; the measurement leaves sliding layers out.

The expected pools come from a numpy version of the rule (the newest `budget` slots of each
sequence, in slot order, into its first target slots), not from the code under test."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_pool import KVPool
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import POLICIES, RowSequence, compress_rows, resolve_budget
from zipage_jax.compress.step import compress, compress_layer, compress_measured
from zipage_jax.engine.runner.steps import compaction_program
from zipage_jax.layers.kv_cache import KVState

BS, M, QL, HKV, GROUP, D = 16, 2, 4, 2, 2, 16
WINDOWS = (0, 12, 0)  # a sliding layer (window 12 < budget 32) between two full-attention layers
LENGTHS = (M + 1, M + 2, M + 4, 0)  # blocks per row; the last row is padding
COMPRESSED = (False, True, False, False)
OFFSETS = (0, 40, 0, 0)  # tokens evicted before (the compressed row's history)
CFG = CompressionConfig(use_global_score=True, enable_pooling=True)


def _batch(seed: int = 0):
    """Rows of different lengths at shuffled blocks, targets in place (row 0) or with a fresh first
    block (the others); per layer random K, V, score history and (for the compressed row)
    increasing history positions."""
    rng = np.random.default_rng(seed)
    batch, width = len(LENGTHS), max(LENGTHS) + 1
    num_pool_blocks = 1 + sum(LENGTHS) + len(LENGTHS) + 2
    free = list(rng.permutation(np.arange(1, num_pool_blocks)))
    tables = np.zeros((batch, width), np.int32)
    targets = np.zeros((batch, width), np.int32)
    for b, n in enumerate(LENGTHS):
        if n:
            tables[b, :n] = [free.pop() for _ in range(n)]
            targets[b, :M + 1] = tables[b, :M + 1]
            if b:
                targets[b, 0] = free.pop()
    shape = (num_pool_blocks, BS, HKV, D)
    layers = []
    for _ in WINDOWS:
        positions = np.zeros(shape[:3], np.int32)
        for b, was_compressed in enumerate(COMPRESSED):
            if was_compressed:  # the M blocks kept at the last compaction: increasing positions < the offset
                for h in range(HKV):
                    kept = np.sort(rng.choice(OFFSETS[b] + M * BS, M * BS, replace=False))
                    positions[tables[b, :M], :, h] = kept.reshape(M, BS)
        layers.append(KVPool(jnp.asarray(rng.standard_normal(shape), jnp.float32),
                             jnp.asarray(rng.standard_normal(shape), jnp.float32),
                             scores=jnp.asarray(rng.uniform(0, 0.02, shape[:3]), jnp.float32),
                             positions=jnp.asarray(positions)))
    queries = [jnp.asarray(rng.standard_normal((batch + 1, QL, HKV * GROUP, D)), jnp.float32) for _ in WINDOWS]
    policy = POLICIES["vnorm-prompt"]  # sinks, a recent window and a prompt reserve: all unlike "most recent"
    budget = resolve_budget(policy, policy.defaults, M, BS, QL)
    rows = compress_rows([budget if n else None for n in LENGTHS], None,
                         [RowSequence(prompt_len=20, evicted=o) for o in OFFSETS])
    args = (jnp.asarray(tables), jnp.asarray(LENGTHS, jnp.int32), jnp.asarray(rng.permutation(batch + 1)[:batch],
            jnp.int32), jnp.asarray(COMPRESSED), jnp.asarray(targets), rows, CFG)
    return layers, queries, args


def _copy(layers):
    return [jax.tree.map(jnp.array, pools) for pools in layers]


def _positions_before(pools: KVPool, tables: np.ndarray, b: int) -> np.ndarray:
    """[T, Hkv] the position of each token of row b's blocks (the rule of docs/ALGORITHM.md
    section 1: history blocks from the cache, the slots written since at slot + offset)."""
    n = LENGTHS[b]
    fresh = np.broadcast_to((np.arange(n * BS) + OFFSETS[b])[:, None], (n * BS, HKV)).copy()
    if COMPRESSED[b]:
        fresh[:M * BS] = np.asarray(pools.positions)[tables[b, :M]].reshape(M * BS, HKV)
    return fresh


def _most_recent_twin(pools: KVPool, tables: np.ndarray, targets: np.ndarray):
    """numpy: every row's newest M*BS slots, in slot order, into its first M target blocks (all
    heads alike); returns the expected k, v and the kept tokens' positions per row [M*BS, Hkv]."""
    k, v = np.array(pools.k), np.array(pools.v)
    before_k, before_v = np.array(pools.k), np.array(pools.v)
    kept_positions = {}
    for b, n in enumerate(LENGTHS):
        if not n:
            continue
        src = np.arange(n * BS - M * BS, n * BS)  # the row's newest budget tokens, oldest first
        dst = np.arange(M * BS)
        src_block, dst_block = tables[b, src // BS], targets[b, dst // BS]
        k[dst_block, dst % BS] = before_k[src_block, src % BS]
        v[dst_block, dst % BS] = before_v[src_block, src % BS]
        kept_positions[b] = _positions_before(pools, tables, b)[src]
    return k, v, kept_positions


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


_compress = jax.jit(compress, static_argnames=("cfg", "backend"))  # windows traced: one compile for any values
_measured = jax.jit(compress_measured, static_argnames=("cfg", "backend"))


def _traced(*windows: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.int32(w) for w in windows)


@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_a_sliding_layer_keeps_its_most_recent_tokens_in_order(backend):
    layers, queries, args = _batch()
    tables, targets = np.asarray(args[0]), np.asarray(args[4])
    expected = [_most_recent_twin(pools, tables, targets) for pools in layers]
    mixed = _compress(_copy(layers), queries, *args, backend=backend, windows=_traced(*WINDOWS))
    policy = _compress(_copy(layers), queries, *args, backend=backend, windows=_traced(0, 0, 0))
    today = _compress(_copy(layers), queries, *args, backend=backend)  # no windows at all
    k, v, kept_positions = expected[1]
    assert _same_bits(mixed[1].k, k) and _same_bits(mixed[1].v, v)
    for b, positions in kept_positions.items():
        dst = np.arange(M * BS)
        got = np.asarray(mixed[1].positions)[targets[b, dst // BS], dst % BS]  # [M*BS, Hkv]
        np.testing.assert_array_equal(got, positions)
        assert (np.diff(got, axis=0) > 0).all()  # temporal order: the window is the last slots
        newest = (LENGTHS[b] * BS - 1) + OFFSETS[b]
        np.testing.assert_array_equal(got[-WINDOWS[1]:], np.arange(newest - WINDOWS[1] + 1, newest + 1)[:, None]
                                      .repeat(HKV, axis=1))
    for layer in (0, 2):  # full-attention layers: bit for bit what they were without windows
        for a, b, c in zip(mixed[layer], policy[layer], today[layer]):
            assert _same_bits(a, b) and _same_bits(a, c)
    # positive control: the policy (sinks, prompt reserve) would have kept other tokens
    assert not _same_bits(policy[1].k, k)
    assert _same_bits(policy[1].k, today[1].k)


def test_the_measurement_averages_the_full_attention_layers_only():
    layers, queries, args = _batch(1)
    _, mixed = _measured(_copy(layers), queries, *args, windows=_traced(*WINDOWS))
    _, full = _measured(_copy(layers), queries, *args, windows=_traced(0, 0, 0))
    _, first = _measured(_copy(layers[:1]), queries[:1], *args)
    _, last = _measured(_copy(layers[2:]), queries[2:], *args)
    np.testing.assert_allclose(np.asarray(mixed), (np.asarray(first) + np.asarray(last)) / 2, rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.asarray(mixed), np.asarray(full))  # positive control: layer 1 counts there
    _, sliding = _measured(_copy(layers), queries, *args, windows=_traced(8, 8, 8))
    assert np.asarray(mixed).max() > 0 and not np.asarray(sliding).any()  # only sliding layers: 0


def test_a_sliding_layer_keeps_the_most_recent_tokens_through_compress_layer():
    layers, queries, args = _batch(2)
    one_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))
    _, sliding = one_layer(_copy(layers)[0], queries[0], *args, window=jnp.int32(8))
    _, policy = one_layer(_copy(layers)[0], queries[0], *args, window=jnp.int32(0))
    keep, chosen = np.asarray(sliding.keep), np.asarray(policy.keep)
    for b, n in enumerate(LENGTHS):
        flat = keep[b].reshape(HKV, -1)
        expected = np.zeros_like(flat)
        if n:
            expected[:, n * BS - M * BS:n * BS] = True
        np.testing.assert_array_equal(flat, expected)
    assert (keep != chosen).any()  # positive control: the policy keeps sinks and older prompt tokens


def test_the_window_reaches_the_runner_program_as_data(caplog):
    """Two layers with different windows through the runner's compaction program: one compile,
    and the window changes what the layer keeps and reports."""
    layers, queries, args = _batch(3)
    tables, num_blocks, query_ids, compressed, targets, rows, _ = args
    blocks = jnp.stack([tables, targets])
    per_row = jnp.concatenate([jnp.stack([num_blocks, query_ids, compressed.astype(jnp.int32)]),
                               jnp.stack([jnp.asarray(r, jnp.int32) for r in rows])])
    call = jax.jit(compaction_program.__wrapped__, static_argnames=("cfg", "backend", "tp", "rope"),
                   donate_argnames=("kv",))  # a fresh cache: only this test's compiles count
    outputs = []
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG):
            for window in (0, 8):
                kv = KVState((_copy(layers)[0],), (jnp.array(queries[0]),))  # donated
                outputs.append(call(kv, blocks, per_row, np.int32(window), cfg=CFG, backend="xla", tp=None, rope=()))
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.getMessage() for r in caplog.records
                if "Compiling" in r.getMessage() and "compaction_program" in r.getMessage()]
    assert len(compiles) == 1, compiles
    (full_kv, full_lost), (sliding_kv, sliding_lost) = outputs
    assert np.asarray(full_lost).max() > 0 and not np.asarray(sliding_lost).any()
    k, v, _ = _most_recent_twin(layers[0], np.asarray(tables), np.asarray(targets))
    assert _same_bits(sliding_kv.pools[0].k, k) and _same_bits(sliding_kv.pools[0].v, v)
    assert not _same_bits(full_kv.pools[0].k, k)  # positive control
