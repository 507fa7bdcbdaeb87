"""Every Pallas kernel lowers to Triton for an H200 at the shapes real models use (on the CPU).

Models (q heads, kv heads, head dim): Qwen3-8B and Llama-3-8B (32, 8, 128), the default
model SmolLM2-135M (9, 3, 64); block sizes 16 and 256; bfloat16 and float32 (compaction:
also int8 K/V with float32 per-token scales, the quantized pool layout; decode and compaction:
packed int4 K/V [.., D / 2] uint8 with float16 scales [.., D / 32]). Lowering runs the
Pallas Triton lowering, so it checks the GPU rules (power-of-two tiles, dot operands,
supported dtypes); it does not compile PTX or run anything.
"""

import jax
import jax.numpy as jnp
import pytest
from h200 import lower_for_h200

from pallas_kernels.attention_score import attention_score
from pallas_kernels.compact import compact
from pallas_kernels.paged_attention import paged_decode_attention

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

MODELS = {"qwen3-8b": (32, 8, 128), "llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
TRITON_CALL = "__gpu$xla.gpu.triton"
BATCH, CONTEXT = 64, 4096  # decode: the bandwidth benchmark's shape
QUERY_CACHE_LEN = 16  # the engine's default query_cache_len
BUDGET_BLOCKS = {16: 24, 256: 3}  # compression: M target blocks (not a power of two)


GRID = [pytest.param(model, block_size, dtype, id=f"{model}-bs{block_size}-{jnp.dtype(dtype).name}")
        for model in MODELS for block_size in (16, 256) for dtype in (jnp.bfloat16, jnp.float32)]


def _pool(block_size, num_kv_heads, *trailing, dtype, width):
    return jax.ShapeDtypeStruct((1 + BATCH * width, block_size, num_kv_heads, *trailing), dtype)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("model, block_size, dtype", GRID)
def test_paged_decode_lowers(model, block_size, dtype):
    q_heads, kv_heads, head_dim = MODELS[model]
    width = CONTEXT // block_size
    q = jax.ShapeDtypeStruct((BATCH, q_heads, head_dim), dtype)
    pool = _pool(block_size, kv_heads, head_dim, dtype=dtype, width=width)
    assert TRITON_CALL in lower_for_h200(paged_decode_attention, q, pool, pool, _i32(BATCH, width),
                                         _i32(BATCH))


@pytest.mark.parametrize("model, block_size, dtype", GRID)
def test_attention_score_lowers(model, block_size, dtype):
    q_heads, kv_heads, head_dim = MODELS[model]
    width = 2 * BUDGET_BLOCKS[block_size]  # the runner's bucket for M + 2 blocks
    queries = jax.ShapeDtypeStruct((BATCH, QUERY_CACHE_LEN, q_heads, head_dim), dtype)
    pool = _pool(block_size, kv_heads, head_dim, dtype=dtype, width=width)
    assert TRITON_CALL in lower_for_h200(attention_score, pool, queries, _i32(BATCH, width),
                                         _i32(BATCH))


def _compact_text(kv_heads, head_dim, block_size, kv_dtype, extra_dtype, int4_groups=None):
    # head_dim: the pool's last axis; int4_groups: an int4 pool's float16 k and v scales [.., groups] move too
    width = 2 * BUDGET_BLOCKS[block_size]
    kv = _pool(block_size, kv_heads, head_dim, dtype=kv_dtype, width=width)
    extra = _pool(block_size, kv_heads, dtype=extra_dtype, width=width)  # score cache or scales
    pools = [kv, kv, extra]
    if int4_groups is not None:
        pools += [_pool(block_size, kv_heads, int4_groups, dtype=jnp.float16, width=width)] * 2
    keep = jax.ShapeDtypeStruct((BATCH, kv_heads, width, block_size), jnp.bool_)
    return lower_for_h200(compact, pools, keep, _i32(BATCH, width), _i32(BATCH, BUDGET_BLOCKS[block_size]))


@pytest.mark.parametrize("model, block_size, dtype", GRID)
def test_compact_lowers_with_its_barrier(model, block_size, dtype):
    _, kv_heads, head_dim = MODELS[model]
    text = _compact_text(kv_heads, head_dim, block_size, dtype, jnp.float32)
    assert TRITON_CALL in text
    assert "gpu.barrier" in text  # the load/store barrier the race-freedom argument rests on


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 256])
def test_compact_lowers_quantized_pools(kv_dtype, block_size):
    assert TRITON_CALL in _compact_text(8, 128, block_size, kv_dtype, jnp.float32)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("block_size", [16, 256])
def test_compact_lowers_int4_pools(model, block_size):
    # packed bytes [.., D / 2] uint8, the float32 score cache and float16 group scales [.., D / 32]
    _, kv_heads, head_dim = MODELS[model]
    text = _compact_text(kv_heads, head_dim // 2, block_size, jnp.uint8, jnp.float32, int4_groups=head_dim // 32)
    assert TRITON_CALL in text and "gpu.barrier" in text


@pytest.mark.parametrize("model, block_size, dtype", GRID)
def test_paged_decode_lowers_int4_pool(model, block_size, dtype):
    q_heads, kv_heads, head_dim = MODELS[model]
    width = CONTEXT // block_size
    q = jax.ShapeDtypeStruct((BATCH, q_heads, head_dim), dtype)
    pool = _pool(block_size, kv_heads, head_dim // 2, dtype=jnp.uint8, width=width)
    scales = _pool(block_size, kv_heads, head_dim // 32, dtype=jnp.float16, width=width)
    assert TRITON_CALL in lower_for_h200(paged_decode_attention, q, pool, pool, _i32(BATCH, width), _i32(BATCH),
                                         k_scales=scales, v_scales=scales)
