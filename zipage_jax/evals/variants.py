"""The policy variants the evaluations measure, by name, and the engine options each needs.

A variant's eviction_policy goes to each request, the rest to the engine, over
group_engine_options' base, where use_global_score is off. Every policy of the registry runs
under its own name with the global score (the engine's default scoring), except "zipage", which
is the reference's recommended setting; then the ablations. Variants that differ only in
eviction_policy share one engine (engine_group).
"""

from __future__ import annotations

from zipage_jax.compress.policies import POLICIES

VARIANTS = {"full": {}, **{name: {"eviction_policy": name, "use_global_score": True} for name in POLICIES}} | {
    "zipage": {"eviction_policy": "zipage", "use_global_score": True, "enable_pooling": True,
               "redundancy": "lightning"},
    "zipage-attn": {"eviction_policy": "zipage"},  # attention only
    "zipage-global": {"eviction_policy": "zipage", "use_global_score": True},
    "window-attn": {"eviction_policy": "window"},  # without the global score
    "window-25": {"eviction_policy": "window", "use_global_score": True, "recent_fraction": 0.25},
    "window-50": {"eviction_policy": "window", "use_global_score": True, "recent_fraction": 0.5},
    "window-pool": {"eviction_policy": "window", "use_global_score": True, "enable_pooling": True},
    "vnorm-window-attn": {"eviction_policy": "vnorm-window"},
    **{f"{p}-{int(100 * r)}": {"eviction_policy": p, "use_global_score": True, "recent_fraction": r}
       for p in ("rkv", "triattention") for r in (0.25, 0.5)},  # their recent share, chosen on dev
}


def engine_group(policy: str, kv_cache_dtype: str = "auto") -> tuple:
    """The engine options a variant needs (everything but the per-request eviction_policy)."""
    options = {k: v for k, v in VARIANTS[policy].items() if k != "eviction_policy"}
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    return tuple(sorted(options.items()))


def group_engine_options(group: tuple, *, block_size: int, query_cache_len: int, longest: int) -> dict:
    """The engine options of an engine group for sequences of up to `longest` tokens."""
    return dict(kvcache_block_size=block_size, query_cache_len=query_cache_len,
                max_num_batched_tokens=max(2048, longest), max_model_len=longest + 64,
                **{"use_global_score": False, **dict(group)})
