"""Eviction policies beyond the reference (docs/ALGORITHM.md section 5), named by `eviction_policy`.

The reference policy ("zipage", docs/ALGORITHM.md section 4) never comes through this module. Each
policy here keeps the reference's scoring pipeline (attention of the cached queries, then the
global score, pooling and redundancy when the config enables them) and changes one or two rules.
Memory stays constant (top-k of exactly `budget_tokens` per (seq, kv head)) and compaction is
the reference's, in place.

- "window": StreamingLLM's attention sinks (the first `sink_len` tokens, 4 when 0) and a
  protected recent window of `recent_fraction * budget_tokens` tokens (at least the query
  tail) on top of the attention score; the rest of the budget goes to the best-scored tokens.
  Sources: StreamingLLM (Xiao et al., ICLR 2024) for the sinks; H2O (Zhang et al., NeurIPS
  2023) splits its budget between heavy hitters and recent tokens, SnapKV (Li et al., 2024)
  always keeps its observation window. Our reasoning: the next tokens depend most on the
  local context, and 16 cached queries estimate long-range importance noisily, so giving a
  fixed share of the budget to the recent past replaces the noisiest choices with safe ones.
  The default share, 0.75, was the best of 0.25 / 0.5 / 0.75 on teacher-forced perplexity, with
  and without the global score (docs/RESULTS.md, "Quality").
- "vnorm-window": "window" with each token's attention score multiplied by the L2 norm of its
  value (VATP: Guo et al., "Attention Score is not All You Need for Token Importance Indicator
  in KV Cache Reduction: Value Also Matters", EMNLP 2024): a token adds attention * value to the
  output, so a heavily attended token with a small value (sinks, punctuation) matters less.
  The engine's default, with the global score on: the best measured on text and reasoning at
  1/8, 1/4 and 1/2 of the context, and at 2,048 tokens (docs/RESULTS.md, "Quality").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zipage_jax.config import CompressionConfig

POLICIES = ("window", "vnorm-window")
DEFAULT_SINKS = 4  # StreamingLLM's sink count, used when sink_len is 0


def uses_value_norm(cfg: CompressionConfig) -> bool:
    return cfg.eviction_policy == "vnorm-window"


def value_norm(v_pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """L2 norm of every value in each sequence's table: [B, Hkv, W, BS] float32."""
    values = v_pool[block_tables].astype(jnp.float32)  # [B, W, BS, Hkv, D]
    return jnp.sqrt((values * values).sum(axis=-1)).transpose(0, 3, 1, 2)


def num_sinks(cfg: CompressionConfig) -> int:
    return cfg.sink_len or DEFAULT_SINKS


def num_recent(cfg: CompressionConfig) -> int:
    """Protected most recent tokens: a share of the budget, never fewer than the query tail."""
    return max(cfg.query_cache_len, int(cfg.recent_fraction * cfg.budget_tokens))


def protect_and_mask(scores: jax.Array, valid: jax.Array, num_blocks: jax.Array, cfg: CompressionConfig) -> jax.Array:
    """Sinks and the recent window +inf, padding -inf.

    scores: [B, Hkv, W, BS]; valid: [B, 1, W, BS] bool; num_blocks: [B] (all valid blocks full).
    """
    width, block_size = scores.shape[-2:]
    pos = jnp.arange(width * block_size).reshape(width, block_size)  # [W, BS]
    length = (num_blocks * block_size)[:, None, None, None]  # [B, 1, 1, 1]
    protected = (pos < num_sinks(cfg)) | (pos >= length - num_recent(cfg))
    scores = jnp.where(protected, jnp.inf, scores)
    return jnp.where(valid, scores, -jnp.inf)
