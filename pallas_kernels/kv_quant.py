"""Placeholder until the kv_quant module lands (issue 17): unquantized pools only."""

from __future__ import annotations

import jax


def quantize(x: jax.Array, dtype):
    raise NotImplementedError("quantized KV pools are not available yet")


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    raise NotImplementedError("quantized KV pools are not available yet")


def check_scales(pool: jax.Array, k_scales, v_scales) -> None:
    if k_scales is not None or v_scales is not None:
        raise ValueError("quantized KV pools are not available yet")
