"""KV budgets for host-only tests that build sequences without an engine's admission."""

from zipage_jax.compress.policies import POLICIES, KVBudget


def zipage_budget(blocks: int | None, block_size: int, query_cache_len: int = 16) -> KVBudget | None:
    """The reference policy's budget of `blocks` blocks (None: full KV)."""
    if blocks is None:
        return None
    return KVBudget(POLICIES["zipage"], blocks, blocks * block_size, 0, query_cache_len)
