"""Paged KV blocks: ref counts, free list, chained prefix hashes, compression targets."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import xxhash

from zipage_jax.engine.sequence import Sequence

DUMMY_BLOCK = 0  # padding target for block tables and writes; never allocated


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class CompressionPlan:
    seq: Sequence
    source_table: list[int]  # blocks read (all full)
    target_table: list[int]  # M + 1 blocks; the first M receive the kept tokens
    release: list[int] = field(default_factory=list)  # dropped from the sequence afterwards


def chain_hash(token_ids: tuple[int, ...] | list[int], prefix: int | None) -> int:
    h = xxhash.xxh64()
    if prefix is not None:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the padding block), got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(1, num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def reset(self) -> None:
        """The device lost the pool's contents: every block is free and the prefix cache empty
        (the sequences' block tables are the caller's to clear; lookup counts stay)."""
        self.blocks = [Block(i) for i in range(len(self.blocks))]
        self.free_block_ids = deque(range(1, len(self.blocks)))
        self.hash_to_block_id = {}

    # -- allocation -------------------------------------------------------------------------

    def _take_free(self) -> int:
        return self.take_free_blocks(1)[0]

    def _forget_hash(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, ()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0
        if block.ref_count == 0:
            self.free_block_ids.append(block_id)  # keeps its hash: a later prompt may reuse it

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> int:
        """Admission: share the cached full blocks of the sequence's tokens, at most `max_blocks`
        (at least one token is always left to compute). Returns the number of cached tokens."""
        assert not seq.num_blocks
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        prefix = None
        table = []
        for i in range(min((len(seq) - 1) // bs, len(seq) if max_blocks is None else max_blocks)):
            tokens = tuple(seq.block_tokens(i))
            h = chain_hash(tokens, prefix)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.free_block_ids.remove(block_id)
            block.ref_count += 1
            table.append(block_id)
            prefix = h
        seq.block_table = table
        seq.num_hashed_blocks = len(table)
        seq.num_computed_tokens = seq.num_kv_slots = len(table) * bs
        return seq.num_computed_tokens

    def count_prefix_lookup(self, seq: Sequence, cached_tokens: int) -> None:
        """Hit-rate stats, once per admission: a failed admission retries the lookup next step."""
        if self.enable_prefix_caching:
            self.prefix_queries += (len(seq) - 1) // self.block_size
            self.prefix_hits += cached_tokens // self.block_size

    def blocks_needed(self, seq: Sequence, num_new_slots: int) -> int:
        total = -(-(seq.num_kv_slots + num_new_slots) // self.block_size)
        return max(0, total - seq.num_blocks)

    def allocate_slots(self, seq: Sequence, num_new_slots: int) -> bool:
        """Grow the block table to hold `num_new_slots` more slots. False if out of blocks."""
        need = self.blocks_needed(seq, num_new_slots)
        if need > self.num_free_blocks:
            return False
        if need:
            seq.append_blocks([self._take_free() for _ in range(need)])
            seq.metrics.kv_blocks_peak = max(seq.metrics.kv_blocks_peak, seq.num_blocks)
        return True

    def allocate_scratch(self, num_blocks: int) -> list[int]:
        """Blocks held outside any sequence's table for one step (a prompt tail's K/V); the caller
        checked that enough are free."""
        return self.take_free_blocks(num_blocks)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drops one reference to each of `block_ids` (a tail's scratch blocks, blocks past a budget)."""
        for block_id in block_ids:
            self._release(block_id)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full of computed tokens whose values the host knows
        (never after compression)."""
        if not self.enable_prefix_caching or seq.compressed:
            return
        bs = self.block_size
        full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // bs, seq.num_blocks)
        hashed = seq.num_hashed_blocks
        if full > hashed:
            self.hash_blocks(seq.block_table, seq.tokens(hashed * bs, full * bs), hashed, full)
            seq.num_hashed_blocks = full

    def hash_blocks(self, table, tokens, first: int, stop: int) -> None:
        """Registers blocks [first, stop) of a sequence's `table` in the prefix cache, their hashes
        chained on the blocks before (`chain_hash`); `tokens`: the token ids of exactly those blocks."""
        bs, blocks, index = self.block_size, self.blocks, self.hash_to_block_id
        prefix = blocks[int(table[first - 1])].hash if first else None
        data = np.asarray(tokens, np.int64)
        raw, ids, width = data.tobytes(), data.tolist(), bs * 8
        for i in range(stop - first):
            chunk = raw[i * width:(i + 1) * width]
            prefix = xxhash.xxh64_intdigest(chunk if prefix is None else prefix.to_bytes(8, "little") + chunk)
            block = blocks[int(table[first + i])]
            block.hash, block.token_ids = prefix, tuple(ids[i * bs:(i + 1) * bs])
            index[prefix] = block.block_id

    def hash_next_blocks(self, tables: np.ndarray, index: np.ndarray, tokens: np.ndarray) -> None:
        """`hash_blocks` of one block per sequence, block `index[i]` of table `tables[i]` holding
        `tokens[i]` ([k, block size] int64), each following a registered block (or first)."""
        blocks, registry = self.blocks, self.hash_to_block_id
        rows = np.arange(len(index))
        before = tables[rows, np.maximum(index - 1, 0)].tolist()
        targets = tables[rows, index].tolist()
        raw, ids, width = tokens.tobytes(), tokens.tolist(), tokens.shape[1] * 8
        for i, (at, prev, block_id) in enumerate(zip(index.tolist(), before, targets)):
            chunk = raw[i * width:(i + 1) * width]
            h = xxhash.xxh64_intdigest(blocks[prev].hash.to_bytes(8, "little") + chunk if at else chunk)
            block = blocks[block_id]
            block.hash, block.token_ids = h, tuple(ids[i])
            registry[h] = block_id

    def take_free_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks off the free list, each held once (the caller checked there are enough)."""
        free, blocks = self.free_block_ids, self.blocks
        taken = [free.popleft() for _ in range(num_blocks)]
        for block_id in taken:
            block = blocks[block_id]
            assert block.ref_count == 0
            if block.hash is not None:
                self._forget_hash(block)
            block.ref_count = 1
        return taken

    # -- compression ------------------------------------------------------------------------

    def plan_compression(self, seq: Sequence) -> CompressionPlan | None:
        """Targets for compacting a full sequence into M blocks (+1 for the next token).

        Shared blocks (ref count > 1) are never overwritten: fresh blocks replace them and the
        shared ones are released. Reused own blocks lose their prefix hash. None when there
        are not enough free blocks for the replacements."""
        m = seq.budget_blocks
        table = seq.block_table
        assert m is not None and len(table) >= m + 1
        keep = table[: m + 1]
        shared = [i for i, b in enumerate(keep) if self.blocks[b].ref_count > 1]
        if len(shared) > self.num_free_blocks:
            return None
        target = list(keep)
        release = table[m + 1:]
        for i in shared:
            release.append(keep[i])
            target[i] = self._take_free()
        if not seq.compressed:  # a compressed sequence's blocks were never hashed
            for i, b in enumerate(target):
                if i not in shared:
                    self._forget_hash(self.blocks[b])
        return CompressionPlan(seq=seq, source_table=table, target_table=target, release=release)

    def finish_compression(self, plan: CompressionPlan) -> None:
        """After the compaction was dispatched: the sequence owns exactly its targets.

        Safe to reuse released blocks at once: every later write is dispatched after the
        compaction that reads them, and the device runs them in that order."""
        for block_id in plan.release:
            self._release(block_id)
        seq = plan.seq
        seq.block_table = plan.target_table
        seq.num_hashed_blocks = 0

    def abort_compression(self, plan: CompressionPlan) -> None:
        """The compaction failed: its replacement blocks go back to the free list and the
        sequence keeps its table (its reused blocks stay out of the prefix cache)."""
        for source, target in zip(plan.source_table, plan.target_table):
            if target != source:
                self._release(target)
