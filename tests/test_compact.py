"""Compaction (Pallas interpret vs jnp vs a numpy check) and the whole compression step."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compress_cases import NUM_KV_HEADS, make_case
from pallas_kernels.compact import compact, compact_reference
from zipage_jax.compress.step import compress, compress_layer
from zipage_jax.config import CompressionConfig

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def _random_keep(case, cfg, seed):
    """Exactly budget_tokens random tokens per valid (seq, head); nothing on padding rows."""
    rng = np.random.default_rng(seed)
    batch, width = case.block_tables.shape
    keep = np.zeros((batch, NUM_KV_HEADS, width * cfg.block_size), bool)
    for b, n in enumerate(case.num_blocks[case.num_blocks > 0]):
        for h in range(NUM_KV_HEADS):
            keep[b, h, rng.choice(n * cfg.block_size, cfg.budget_tokens, replace=False)] = True
    return keep.reshape(batch, NUM_KV_HEADS, width, cfg.block_size)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _assert_compacted(before, after, keep, case, cfg):
    """Each head's kept tokens, in order, fill the first M target blocks; all else unchanged."""
    bs, m = cfg.block_size, cfg.budget_blocks
    touched = np.zeros(before.shape[:1], bool)
    for b, n in enumerate(case.num_blocks):
        if n == 0:
            continue
        targets = case.target_tables[b, :m]
        touched[targets] = True
        source = before[case.block_tables[b, :n]]  # [n, BS, Hkv, ...]
        for h in range(NUM_KV_HEADS):
            kept = source[:, :, h].reshape(n * bs, *before.shape[3:])[keep[b, h, :n].reshape(-1)]
            packed = after[targets][:, :, h].reshape(m * bs, *before.shape[3:])
            assert _same_bits(packed, kept), (b, h)
    assert _same_bits(after[~touched], before[~touched])  # incl. the dummy block 0 and padding targets


@pytest.mark.parametrize("block_size,with_scores", [(16, True), (32, False), (64, True)])
def test_compact_moves_kept_tokens_in_order(block_size, with_scores):
    cfg = CompressionConfig(budget_blocks=3 if block_size == 16 else 2, block_size=block_size)
    case = make_case(block_size, cfg, 1)
    keep = _random_keep(case, cfg, block_size)
    pools = (jnp.asarray(case.k_pool), jnp.asarray(case.v_pool),
             jnp.asarray(case.score_cache) if with_scores else None)
    tables = jnp.asarray(case.block_tables)
    targets = jnp.asarray(case.target_tables[:, : cfg.budget_blocks])
    ref = compact_reference(*pools, jnp.asarray(keep), tables, targets)
    ours = compact(*pools, jnp.asarray(keep), tables, targets, interpret=True)
    befores = (case.k_pool, case.v_pool, case.score_cache)
    for name, before, r, o in zip(("k", "v", "score"), befores, ref, ours):
        if r is None:
            assert o is None and not with_scores
            continue
        assert _same_bits(o, r), name
        _assert_compacted(before, np.asarray(r), keep, case, cfg)


def test_compact_checks_shapes():
    cfg = CompressionConfig(budget_blocks=1, block_size=16)
    case = make_case(0, cfg, 1)
    keep = jnp.asarray(_random_keep(case, cfg, 0))
    k, v = jnp.asarray(case.k_pool), jnp.asarray(case.v_pool)
    tables, targets = jnp.asarray(case.block_tables), jnp.asarray(case.target_tables)
    with pytest.raises(ValueError, match="keep"):
        compact_reference(k, v, None, keep[:, :1], tables, targets)
    with pytest.raises(ValueError, match="score_cache"):
        compact(k, v, jnp.zeros((3, 16, 2)), keep, tables, targets, interpret=True)


def _layers(case, seed, num_layers=2):
    """Per-layer pools: layer 0 is the case's, later layers are shuffled copies."""
    rng = np.random.default_rng(seed)
    out = {"k": [], "v": [], "s": [], "q": []}
    for layer in range(num_layers):
        perm = rng.permutation(NUM_KV_HEADS) if layer else np.arange(NUM_KV_HEADS)
        out["k"].append(case.k_pool[:, :, perm])
        out["v"].append(case.v_pool[:, :, perm])
        out["s"].append(case.score_cache[:, :, perm])
        out["q"].append(case.query_cache[:, ::-1] if layer else case.query_cache)
    return out


def test_compress_step_donated_backends_agree():
    cfg = CompressionConfig(budget_blocks=2, block_size=16, query_cache_len=8, use_global_score=True,
                            enable_pooling=True, redundancy="lightning")
    case = make_case(5, cfg, 2)
    layers = _layers(case, 5)
    batch_args = dict(
        block_tables=jnp.asarray(case.block_tables), num_blocks=jnp.asarray(case.num_blocks),
        query_ids=jnp.asarray(case.query_ids), compressed=jnp.asarray(case.compressed),
        target_tables=jnp.asarray(case.target_tables),
    )
    step = jax.jit(compress, static_argnames=("cfg", "backend"),
                   donate_argnames=("k_pools", "v_pools", "score_caches"))
    results = {}
    for backend in ("xla", "pallas-interpret"):
        k_pools = [jnp.asarray(x) for x in layers["k"]]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # "donated buffers were not usable"
            results[backend] = step(k_pools, *([jnp.asarray(x) for x in layers[key]] for key in "vsq"),
                                    **batch_args, cfg=cfg, backend=backend)
        assert all(x.is_deleted() for x in k_pools)
    one_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))
    for layer in range(len(layers["k"])):
        k, v, s, stages = one_layer(
            *(jnp.asarray(layers[key][layer]) for key in "kvsq"), **batch_args, cfg=cfg,
        )
        _assert_compacted(layers["k"][layer], np.asarray(k), np.asarray(stages.keep), case, cfg)
        for backend, (ks, vs, ss) in results.items():
            assert _same_bits(ks[layer], k) and _same_bits(vs[layer], v), backend
            np.testing.assert_allclose(np.asarray(ss[layer]), np.asarray(s), rtol=0, atol=1e-6)


def test_compress_step_checks_inputs():
    cfg = CompressionConfig(budget_blocks=1, block_size=16, query_cache_len=4, use_global_score=True)
    case = make_case(6, cfg, 1)
    args = ([jnp.asarray(case.k_pool)], [jnp.asarray(case.v_pool)], [jnp.asarray(case.score_cache)],
            [jnp.asarray(case.query_cache)], jnp.asarray(case.block_tables),
            jnp.asarray(case.num_blocks), jnp.asarray(case.query_ids), jnp.asarray(case.compressed))
    targets = jnp.asarray(case.target_tables)
    with pytest.raises(ValueError, match="backend"):
        compress(*args, targets, cfg, backend="cuda")
    with pytest.raises(ValueError, match="target_tables"):
        compress(*args, targets[:, :1], cfg)
    with pytest.raises(ValueError, match="score_caches"):
        compress(*args[:2], None, *args[3:], targets, cfg)
