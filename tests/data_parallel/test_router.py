"""The data-parallel Router, without Ray: prefix hashes as the engine's prefix cache computes
them, cache-aware routing against round robin, the balance and cache thresholds, load accounting."""

from __future__ import annotations

import random

import pytest

from zipage_jax.data_parallel.router import (
    BALANCE_ABS_BLOCKS,
    ROUTING_POLICIES,
    Router,
    prompt_block_hashes,
)
from zipage_jax.engine.block_manager import BlockManager
from zipage_jax.engine.sequence import Sequence
from zipage_jax.server.config import ROUTING_POLICIES as SERVER_ROUTING_POLICIES

BS = 16


def test_the_prompt_hashes_are_the_blocks_the_engine_serves_from_its_prefix_cache():
    bm = BlockManager(64, BS)
    prompt = list(range(100, 100 + 5 * BS + 3))
    first = Sequence(list(prompt), BS)
    assert bm.allocate_slots(first, len(prompt))
    first.num_computed_tokens = first.num_kv_slots = len(prompt)
    bm.commit_full_blocks(first)
    hashes = prompt_block_hashes(prompt, BS)
    assert len(hashes) == 5 and set(hashes) <= set(bm.hash_to_block_id)
    assert bm.match_prefix(Sequence(list(prompt), BS)) == len(hashes) * BS
    # the block before the last token is never served from the cache: a prompt of exactly 5 blocks has 4
    assert len(prompt_block_hashes(prompt[:5 * BS], BS)) == 4
    # a change in block 2 changes every hash from there on (they are chained)
    changed = prompt[:2 * BS] + [7] + prompt[2 * BS + 1:]
    assert prompt_block_hashes(changed, BS)[:2] == hashes[:2]
    assert not set(prompt_block_hashes(changed, BS)[2:]) & set(hashes)


def shared_prefix_workload(num_prefixes: int = 4, per_prefix: int = 6, prefix_blocks: int = 12) -> list[list[int]]:
    """Prompts sharing `num_prefixes` long prefixes, each with its own suffix, in a shuffled order
    (an interleaved order would let round robin pin each prefix to one replica by chance)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 300) for _ in range(prefix_blocks * BS)] for _ in range(num_prefixes)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(10)] for prefix in prefixes for _ in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


def cached_blocks_hit(policy: str, prompts: list[list[int]], num_replicas: int = 2) -> int:
    """Prompt blocks found in the routed replica's cache, requests running one after another."""
    router = Router(num_replicas, BS, policy)
    caches: list[set[int]] = [set() for _ in range(num_replicas)]
    hits = 0
    for i, prompt in enumerate(prompts):
        replica = router.route(f"r{i}", prompt, 16, range(num_replicas))
        hashes = prompt_block_hashes(prompt, BS)
        hits += next((n for n, h in enumerate(hashes) if h not in caches[replica]), len(hashes))
        caches[replica].update(hashes)
        router.finish(f"r{i}")
    return hits


def test_cache_aware_routing_hits_the_prefix_cache_where_round_robin_misses():
    prompts = shared_prefix_workload()
    cache_aware, round_robin = cached_blocks_hit("cache_aware", prompts), cached_blocks_hit("round_robin", prompts)
    assert cache_aware == 4 * 5 * 12  # every prefix computed once, on one replica
    assert round_robin <= 4 * 4 * 12  # each prefix computed on both replicas
    assert cache_aware > round_robin


def test_round_robin_takes_the_eligible_replicas_in_turn():
    router = Router(3, BS, "round_robin")
    assert [router.route(f"r{i}", [1] * 40, 8, [0, 1, 2]) for i in range(4)] == [0, 1, 2, 0]
    assert [router.route(f"s{i}", [1] * 40, 8, [0, 2]) for i in range(3)] == [2, 0, 2]


def test_without_a_useful_match_the_least_loaded_replica_gets_the_request():
    router = Router(2, BS)
    assert router.route("a", list(range(3, 3 + 4 * BS)), 100, [0, 1]) == 0
    assert router.route("b", list(range(500, 500 + 4 * BS)), 10, [0, 1]) == 1  # replica 0 carries a's tokens
    assert router.load(0) == 4 * BS + 100 and router.load(1) == 4 * BS + 10


def test_a_match_above_the_cache_threshold_wins_over_the_load_and_ties_go_to_the_less_loaded():
    router = Router(3, BS)
    prefix = list(range(3, 3 + 10 * BS))
    router.route("seed", prefix + [1], 500, [0])  # replica 0 caches the 10 blocks and carries 500 tokens
    assert router.route("hit", prefix + [2], 8, [0, 1, 2]) == 0
    # a match of 3 of 10 blocks is not above 0.3: the least loaded replica gets it
    router.finish("hit")
    assert router.route("weak", prefix[:3 * BS] + list(range(900, 901 + 7 * BS)), 8, [0, 1, 2]) == 1
    # 4 of 10 blocks are: replica 0, although it is busier
    assert router.route("strong", prefix[:4 * BS] + list(range(900, 901 + 6 * BS)), 8, [0, 1, 2]) == 0
    router.route("copy", prefix + [3], 8, [2])  # replica 2 now holds the prefix too, with less load than 0
    assert router.route("tie", prefix + [4], 8, [0, 1, 2]) == 2


PREFIX = list(range(3, 3 + 8 * BS))


def router_with_loads(load0: int, load1: int) -> Router:
    """Replica 0 holds PREFIX; the replicas carry `load0` and `load1` tokens."""
    router = Router(2, BS)
    router.route("seed", PREFIX + [1], load0 - len(PREFIX) - 1, [0])
    if load1:
        other = list(range(900, 900 + 8 * BS))
        router.route("other", other, load1 - len(other), [1])
    assert (router.load(0), router.load(1)) == (load0, load1)
    return router


@pytest.mark.parametrize("loads, replica", [
    ((BALANCE_ABS_BLOCKS * BS + 200, 0), 1),  # over both thresholds: the least loaded
    ((int(4.2 * BALANCE_ABS_BLOCKS * BS), 3 * BALANCE_ABS_BLOCKS * BS), 0),  # over the absolute one only
    ((int(0.9 * BALANCE_ABS_BLOCKS * BS), 0), 0),  # over the relative one only
])
def test_an_unbalanced_load_overrides_the_prefix_match(loads, replica):
    assert Router(2, BS).balance_abs_threshold == BALANCE_ABS_BLOCKS * BS == 1024
    assert router_with_loads(*loads).route("next", PREFIX + [2], 8, [0, 1]) == replica


def test_the_load_is_the_tokens_in_flight_uncached_prompt_then_tokens_still_to_come():
    router = Router(2, BS)
    prompt = list(range(3, 3 + 6 * BS + 5))
    router.route("a", prompt, 50, [0])
    assert router.load(0) == len(prompt) + 50
    router.route("b", prompt, 50, [0])  # 6 blocks cached there (from a): only the rest counts
    assert router.load(0) == len(prompt) + 50 + 5 + 50
    router.progress("a", 1)  # a's prompt is computed, its first token arrived
    assert router.load(0) == 49 + 5 + 50
    router.progress("a", 100)  # never below zero
    router.finish("b")
    assert router.load(0) == 0
    router.finish("a")
    router.finish("unknown")
    assert router.load(0) == 0
    router.forget_replica(0)  # it restarted: its cache is gone
    router.route("c", prompt, 1, [0])
    assert router.load(0) == len(prompt) + 1


def test_the_cached_set_is_a_bounded_lru():
    router = Router(1, BS, max_cached_blocks=8)
    old, new = list(range(3, 3 + 6 * BS + 1)), list(range(200, 200 + 6 * BS + 1))
    router.route("old", old, 1, [0])
    router.route("new", new, 1, [0])
    router.finish("old")
    router.finish("new")
    router.route("again", old, 1, [0])  # old's first 4 blocks were evicted: all of it is computed again
    assert router.load(0) == len(old) + 1


def test_bad_values_are_refused_and_the_server_offers_the_same_policies():
    assert SERVER_ROUTING_POLICIES == ROUTING_POLICIES
    with pytest.raises(ValueError, match="routing policy must be one of cache_aware, round_robin"):
        Router(2, BS, "random")
    with pytest.raises(ValueError, match="no replica to route to"):
        Router(2, BS).route("a", [1, 2], 1, [])
