"""Compaction (Pallas interpret vs jnp vs a numpy twin) and the whole compression step."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compress_cases import NUM_KV_HEADS, CaseConfig, compress_args, make_case, scoring

from pallas_kernels import kv_quant
from pallas_kernels.compact import _chunk_rows, compact, compact_reference
from pallas_kernels.kv_pool import KVPool
from zipage_jax.bench.compact_cases import PATTERNS, compaction_case, num_pool_blocks
from zipage_jax.compress.step import compress, compress_layer

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _twin(pool, keep, tables, targets):
    """numpy: per (seq, head) the kept tokens, in order, overwrite the first target slots."""
    out = np.array(pool)
    bs = pool.shape[1]
    slots = out.reshape(-1, *pool.shape[2:])  # a view: [NB*BS, Hkv, ...]
    for b in range(tables.shape[0]):
        for h in range(pool.shape[2]):
            rows = pool[tables[b], :, h].reshape(-1, *pool.shape[3:])  # [W*BS, ...] logical order
            kept = rows[keep[b, h].reshape(-1)][: targets.shape[1] * bs]
            d = np.arange(len(kept))
            slots[targets[b, d // bs] * bs + d % bs, h] = kept
    return out


def _random_keep(case, cfg, seed):
    """Exactly budget_tokens random tokens per valid (seq, head); nothing on padding rows."""
    rng = np.random.default_rng(seed)
    batch, width = case.block_tables.shape
    keep = np.zeros((batch, NUM_KV_HEADS, width * cfg.block_size), bool)
    for b, n in enumerate(case.num_blocks[case.num_blocks > 0]):
        for h in range(NUM_KV_HEADS):
            keep[b, h, rng.choice(n * cfg.block_size, cfg.budget_tokens, replace=False)] = True
    return keep.reshape(batch, NUM_KV_HEADS, width, cfg.block_size)


@pytest.mark.parametrize("block_size,with_scores", [(16, True), (32, False), (64, True)])
def test_compact_moves_kept_tokens_in_order(block_size, with_scores):
    cfg = CaseConfig(budget_blocks=3 if block_size == 16 else 2, block_size=block_size)
    case = make_case(block_size, cfg, 1)
    keep = _random_keep(case, cfg, block_size)
    befores = [case.k_pool, case.v_pool] + ([case.score_cache] if with_scores else [])
    pools = [jnp.asarray(x) for x in befores]
    tables = jnp.asarray(case.block_tables)
    targets = case.target_tables[:, : cfg.budget_blocks]
    ref = compact_reference(pools, jnp.asarray(keep), tables, jnp.asarray(targets))
    ours = compact(pools, jnp.asarray(keep), tables, jnp.asarray(targets), interpret=True)
    assert len(ours) == len(ref) == len(befores)
    for before, r, o in zip(befores, ref, ours):
        assert _same_bits(o, r)
        assert _same_bits(r, _twin(before, keep, case.block_tables, targets))


# -- adversarial keep patterns -------------------------------------------------------------------

SEQS, WIDTH, BUDGET = 3, 6, 3  # in place, all-fresh targets, first target fresh; then a padding row


def _random_pool(rng, shape, dtype):
    """Random bits, so every slot differs (NaN and inf included: compared bit for bit)."""
    raw = rng.integers(0, 256, (*shape, jnp.dtype(dtype).itemsize), np.uint8)
    return raw.view(jnp.dtype(dtype)).reshape(shape)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_compact_adversarial_patterns_match_reference_and_twin(dtype, block_size):
    rng = np.random.default_rng(block_size)
    shape = (num_pool_blocks(SEQS, WIDTH, BUDGET), block_size, NUM_KV_HEADS)
    # keys; wide values (chunks of 16 < BS at BS 64); per-token scales; a float32 score cache
    pools = [_random_pool(rng, shape + (16,), dtype), _random_pool(rng, shape + (512,), dtype),
             _random_pool(rng, shape, dtype), _random_pool(rng, shape, jnp.float32)]
    _assert_patterns_move_every_pool(pools, block_size)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compact_int4_pools_match_reference_and_twin(head_dim, block_size):
    # packed int4 keys and values [.., D / 2] uint8, their float16 group scales [.., D / 32], the score cache
    rng = np.random.default_rng(head_dim + block_size)
    shape = (num_pool_blocks(SEQS, WIDTH, BUDGET), block_size, NUM_KV_HEADS)
    packed = [_random_pool(rng, shape + (head_dim // 2,), jnp.uint8) for _ in range(2)]
    scales = [_random_pool(rng, shape + (head_dim // 32,), jnp.float16) for _ in range(2)]
    _assert_patterns_move_every_pool([*packed, *scales, _random_pool(rng, shape, jnp.float32)], block_size)


def _assert_patterns_move_every_pool(pools, block_size):
    """Every keep pattern: the Pallas kernel (interpreted) and the reference move each pool bit for
    bit as the numpy twin does."""
    device_pools = [jnp.asarray(p) for p in pools]
    cases = [(name, 0) for name in PATTERNS] + [("random", seed) for seed in range(1, 7)]
    for name, seed in cases:
        tables, targets, keep = compaction_case(name, 1000 * block_size + seed, num_seqs=SEQS,
                                                num_kv_heads=NUM_KV_HEADS, width=WIDTH, budget=BUDGET,
                                                block_size=block_size)
        args = (jnp.asarray(keep), jnp.asarray(tables), jnp.asarray(targets))
        ours = compact(device_pools, *args, interpret=True)
        ref = compact_reference(device_pools, *args)
        for j, (before, o, r) in enumerate(zip(pools, ours, ref)):
            expected = _twin(before, keep, tables, targets)
            assert _same_bits(r, expected), (name, seed, j)
            assert _same_bits(o, expected), (name, seed, j)


def test_chunk_rows():
    pool = lambda *trailing: jax.ShapeDtypeStruct((3, 256, 2, *trailing), jnp.bfloat16)  # noqa: E731
    assert _chunk_rows([pool(128), pool()], 256) == 64  # 64 x 128 = 8192 elements
    assert _chunk_rows([pool(64)], 16) == 16
    assert _chunk_rows([pool()], 256) == 256
    assert _chunk_rows([pool(96)], 256) == 64  # largest power of two with 96 * S <= 8192


def test_compact_checks_shapes():
    cfg = CaseConfig(budget_blocks=1, block_size=16)
    case = make_case(0, cfg, 1)
    keep = jnp.asarray(_random_keep(case, cfg, 0))
    k, v = jnp.asarray(case.k_pool), jnp.asarray(case.v_pool)
    tables, targets = jnp.asarray(case.block_tables), jnp.asarray(case.target_tables)
    with pytest.raises(ValueError, match="keep"):
        compact_reference([k, v], keep[:, :1], tables, targets)
    with pytest.raises(ValueError, match="agree"):
        compact([k, v, jnp.zeros((3, 16, 2))], keep, tables, targets, interpret=True)
    with pytest.raises(ValueError, match="non-empty"):
        compact([], keep, tables, targets, interpret=True)
    with pytest.raises(ValueError, match="power-of-two"):
        compact([k[..., :12]], keep, tables, targets)
    with pytest.raises(ValueError, match="int32"):
        compact_reference([k], keep, tables, targets.astype(jnp.int16))


# -- the whole compression step ------------------------------------------------------------------


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


def _pool(layers: dict, i: int) -> KVPool:
    return KVPool(jnp.asarray(layers["k"][i]), jnp.asarray(layers["v"][i]), scores=jnp.asarray(layers["s"][i]))


def test_compress_step_donated_backends_agree():
    cfg = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=8,
                     scoring=scoring(use_global_score=True, enable_pooling=True, redundancy="lightning"))
    case = make_case(5, cfg, 2)
    layers = _layers(case, 5)
    _, queries, *batch, rows, compression = compress_args(case, cfg)
    queries = [jnp.asarray(q) for q in layers["q"]]
    step = jax.jit(compress, static_argnames=("cfg", "backend"), donate_argnames=("layers",))
    results = {}
    for backend in ("xla", "pallas-interpret"):
        pools = [_pool(layers, i) for i in range(len(layers["k"]))]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # "donated buffers were not usable"
            results[backend] = step(pools, queries, *batch, rows, cfg=compression, backend=backend)
        assert all(p.k.is_deleted() for p in pools)
    one_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))
    targets = case.target_tables[:, : cfg.budget_blocks]
    for layer in range(len(layers["k"])):
        moved, stages = one_layer(_pool(layers, layer), queries[layer], *batch, rows, cfg=compression)
        k, v, s = moved.k, moved.v, moved.scores
        keep = np.asarray(stages.keep)
        assert _same_bits(k, _twin(layers["k"][layer], keep, case.block_tables, targets))
        for backend, out in results.items():
            assert _same_bits(out[layer].k, k) and _same_bits(out[layer].v, v), backend
            np.testing.assert_allclose(np.asarray(out[layer].scores), np.asarray(s), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compress_step_moves_quantization_scales_with_their_tokens():
    cfg = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=4)
    case = make_case(7, cfg, 2)
    k, v = (jnp.asarray(np.nan_to_num(x), jnp.float32) for x in (case.k_pool, case.v_pool))
    (kq, ks), (vq, vs) = kv_quant.quantize(k, jnp.int8), kv_quant.quantize(v, jnp.int8)
    pools = [KVPool(kq, vq, ks, vs)]
    out = compress(*compress_args(case, cfg, pools), backend="xla")[0]
    query_caches, *rest = compress_args(case, cfg)[1:]
    one_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))
    _, stages = one_layer(pools[0], query_caches[0], *rest)
    keep = np.asarray(stages.keep)
    targets = case.target_tables[:, : cfg.budget_blocks]
    for moved, before in ((out.k, kq), (out.k_scales, ks), (out.v_scales, vs)):
        assert _same_bits(moved, _twin(np.asarray(before), keep, case.block_tables, targets))
    # the scores used the dequantized keys: the same keep as scoring the dequantized pools
    dk, dv = kv_quant.dequantize(kq, ks, jnp.float32), kv_quant.dequantize(vq, vs, jnp.float32)
    _, plain = one_layer(KVPool(dk, dv), query_caches[0], *rest)
    np.testing.assert_array_equal(np.asarray(plain.keep), keep)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_compress_step_moves_int4_bytes_and_group_scales_with_their_tokens(backend):
    """An int4 pool (head_dim 64: packed [.., 32] uint8, float16 scales [.., 2]) and the float32
    score cache through the whole step: bytes and scales move bit for bit with their tokens."""
    cfg = CaseConfig(budget_blocks=2, block_size=16, query_cache_len=4, scoring=scoring(use_global_score=True))
    case = make_case(8, cfg, 2)
    rng = np.random.default_rng(8)

    def widen(x):  # [..., 16] -> [..., 64]: the case's channels and three noisy copies
        copies = [x + 0.5 * rng.standard_normal(x.shape).astype(x.dtype) for _ in range(3)]
        return np.concatenate([x, *copies], axis=-1)

    case = dataclasses.replace(case, k_pool=widen(case.k_pool), v_pool=widen(case.v_pool),
                               query_cache=widen(case.query_cache))
    k, v = (jnp.asarray(np.nan_to_num(x), jnp.float32) for x in (case.k_pool, case.v_pool))
    (kq, ks), (vq, vs) = kv_quant.quantize(k, jnp.uint8), kv_quant.quantize(v, jnp.uint8)
    assert (kq.shape[-1], ks.shape[-1], ks.dtype) == (32, 2, jnp.float16)
    pools = [KVPool(kq, vq, ks, vs, scores=jnp.asarray(np.nan_to_num(case.score_cache)))]
    out = compress(*compress_args(case, cfg, pools), backend=backend)[0]
    query_caches, *rest = compress_args(case, cfg)[1:]
    one_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))
    reference, stages = one_layer(pools[0], query_caches[0], *rest)
    keep = np.asarray(stages.keep)
    targets = case.target_tables[:, : cfg.budget_blocks]
    for moved, before in ((out.k, kq), (out.v, vq), (out.k_scales, ks), (out.v_scales, vs)):
        assert _same_bits(moved, _twin(np.asarray(before), keep, case.block_tables, targets))
    np.testing.assert_allclose(np.asarray(out.scores), np.asarray(reference.scores), rtol=0, atol=1e-6)
    # the scores used the unpacked, dequantized keys: the same keep as scoring the dequantized pools
    dk, dv = kv_quant.dequantize(kq, ks, jnp.float32), kv_quant.dequantize(vq, vs, jnp.float32)
    _, plain = one_layer(KVPool(dk, dv, scores=pools[0].scores), query_caches[0], *rest)
    np.testing.assert_array_equal(np.asarray(plain.keep), keep)


def test_compress_step_checks_inputs():
    cfg = CaseConfig(budget_blocks=1, block_size=16, query_cache_len=4, scoring=scoring(use_global_score=True))
    case = make_case(6, cfg, 1)
    pools, queries, tables, num_blocks, query_ids, compressed, targets, rows, compression = compress_args(case, cfg)
    with pytest.raises(ValueError, match="backend"):
        compress(pools, queries, tables, num_blocks, query_ids, compressed, targets, rows, compression, backend="cuda")
    with pytest.raises(ValueError, match="target_tables"):
        compress(pools, queries, tables, num_blocks, query_ids, compressed, targets[:, :1], rows, compression)
    with pytest.raises(ValueError, match="score cache"):
        compress([pools[0]._replace(scores=None)], queries, tables, num_blocks, query_ids, compressed, targets, rows,
                 compression)
    with pytest.raises(ValueError, match="rows.budget"):
        compress(pools, queries, tables, num_blocks, query_ids, compressed, targets,
                 rows._replace(budget=rows.budget[:1]), compression)
