"""Router: which replica a request goes to, from each replica's load and the prompt prefixes it
was sent (pure Python: no Ray).

Prefix affinity follows the engine's own prefix cache: a prompt's full blocks are hashed as
BlockManager does (`chain_hash` over `block_size` tokens, each hash chained to the one before,
the last token never counted), and each replica keeps a bounded LRU set of the block hashes it
was sent. A replica's match is the run of leading prompt blocks it holds, as a fraction of the
prompt's blocks.

A replica's load is its tokens in flight: for each request it holds, the prompt tokens it has
not cached (the prompt less its matched blocks) until its first token arrives, plus the tokens
still to generate (max_tokens x n, less those that arrived); a request that finishes, is
aborted or moves to another replica leaves no load behind.

`cache_aware` (the rule of vllm-router and SGLang's gateway, in tokens): when the load is
unbalanced (busiest - idlest > balance_abs_threshold and busiest > balance_rel_threshold x idlest)
the least loaded replica; else, when the best match exceeds cache_threshold, the replica with the
longest match (ties: the less loaded); else the least loaded. `round_robin`: each eligible
replica in turn. Replicas equal on all counts are taken in turn as well.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from zipage_jax.engine.block_manager import chain_hash

ROUTING_POLICIES = ("cache_aware", "round_robin")
BALANCE_ABS_BLOCKS = 64  # the absolute imbalance threshold, in blocks of uncomputed tokens (see Router)
BALANCE_REL_THRESHOLD = 1.5
CACHE_THRESHOLD = 0.3


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's blocks the engine's prefix cache can hold
    (BlockManager.match_prefix: the full blocks before the last token)."""
    hashes: list[int] = []
    prefix = None
    for i in range((len(token_ids) - 1) // block_size):
        prefix = chain_hash(token_ids[i * block_size:(i + 1) * block_size], prefix)
        hashes.append(prefix)
    return hashes


@dataclass
class _Assignment:
    replica: int
    prompt_tokens: int  # uncached prompt tokens, until the first token arrives
    decode_tokens: int  # tokens still to generate


class Router:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "cache_aware", *,
                 max_cached_blocks: int = 1 << 20, balance_abs_threshold: int | None = None,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, cache_threshold: float = CACHE_THRESHOLD):
        """`max_cached_blocks`: the LRU bound per replica (its KV pool's blocks: it cannot cache
        more). `balance_abs_threshold` (tokens) defaults to BALANCE_ABS_BLOCKS x block_size: the
        gateways' 64 counts requests whatever their size; counted in blocks, the prefix cache's
        unit, 64 blocks (16,384 tokens at the default block size of 256, eight prefill steps of
        2,048 tokens) is more work than affinity saves a request (its cached prefix: a few to a
        few dozen blocks), so beyond it balance comes first. Raises ValueError for a bad value."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if num_replicas < 1 or block_size < 1 or max_cached_blocks < 1:
            raise ValueError(f"need at least one replica, block and cached block, got {num_replicas}, "
                             f"{block_size}, {max_cached_blocks}")
        self.policy, self.block_size = policy, block_size
        self.max_cached_blocks = max_cached_blocks
        self.balance_abs_threshold = (BALANCE_ABS_BLOCKS * block_size if balance_abs_threshold is None
                                      else balance_abs_threshold)
        self.balance_rel_threshold, self.cache_threshold = balance_rel_threshold, cache_threshold
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._loads = [0] * num_replicas
        self._assignments: dict[str, _Assignment] = {}
        self._next = 0  # the replica after the latest one routed to: round robin's next, and the first of equals

    def load(self, replica: int) -> int:
        return self._loads[replica]

    def route(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: int,
              eligible: Sequence[int]) -> int:
        """The replica for the request, among `eligible` (not empty); its load and prefix are
        counted there from now on."""
        if not eligible:
            raise ValueError("no replica to route to")
        hashes = prompt_block_hashes(prompt_ids, self.block_size)
        matches = {r: self._match(r, hashes) for r in eligible}
        if self.policy == "round_robin":
            replica = self._round_robin(eligible)
        else:
            replica = self._cache_aware(matches, len(hashes))
        self._remember(replica, hashes)
        self._next = (replica + 1) % len(self._loads)
        assignment = _Assignment(replica, len(prompt_ids) - matches[replica] * self.block_size, max_new_tokens)
        self._assignments[request_id] = assignment
        self._loads[replica] += assignment.prompt_tokens + assignment.decode_tokens
        return replica

    def progress(self, request_id: str, new_tokens: int) -> None:
        """Tokens of the request arrived: its prompt is computed, `new_tokens` fewer are to come."""
        a = self._assignments.get(request_id)
        if a is None:
            return
        done = a.prompt_tokens + min(new_tokens, a.decode_tokens)
        a.prompt_tokens, a.decode_tokens = 0, a.decode_tokens - min(new_tokens, a.decode_tokens)
        self._loads[a.replica] -= done

    def finish(self, request_id: str) -> None:
        """The request left its replica (finished, aborted or moved): its load goes."""
        a = self._assignments.pop(request_id, None)
        if a is not None:
            self._loads[a.replica] -= a.prompt_tokens + a.decode_tokens

    def forget_replica(self, replica: int) -> None:
        """The replica lost its cache (it restarted): nothing is cached there any more."""
        self._cached[replica].clear()

    def _match(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of the prompt the replica holds."""
        cached = self._cached[replica]
        run = 0
        for h in hashes:
            if h not in cached:
                break
            run += 1
        return run

    def _cache_aware(self, matches: dict[int, int], num_blocks: int) -> int:
        loads = {r: self._loads[r] for r in matches}
        least_loaded = min(matches, key=lambda r: (loads[r], self._turn(r)))
        busiest, idlest = max(loads.values()), loads[least_loaded]
        if busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest:
            return least_loaded
        best = max(matches, key=lambda r: (matches[r], -loads[r], -self._turn(r)))
        if num_blocks and matches[best] / num_blocks > self.cache_threshold:
            return best
        return least_loaded

    def _turn(self, replica: int) -> int:
        """How many replicas come before `replica` in round-robin order (ties go round)."""
        return (replica - self._next) % len(self._loads)

    def _round_robin(self, eligible: Sequence[int]) -> int:
        return min(eligible, key=self._turn)

    def _remember(self, replica: int, hashes: list[int]) -> None:
        cached = self._cached[replica]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.max_cached_blocks:
            cached.popitem(last=False)
