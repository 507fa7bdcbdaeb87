"""The one door to the device: jitted steps over the donated KV state, bucketed shapes.

Per engine step: (1) compaction of the sequences that reached their budget, (2) prefill
chunks, (3) decodes; each is one jitted call that donates the KV state, dispatched without
waiting, so a compaction never blocks the host. Tokens come back once, at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from zipage_jax.compress.step import compress
from zipage_jax.config import CompressionConfig, EngineConfig
from zipage_jax.engine.block_manager import DUMMY_BLOCK, CompressionPlan
from zipage_jax.engine.kv_state import KVState
from zipage_jax.engine.scheduler import Chunk
from zipage_jax.engine.sharding import TensorParallel, shard_model
from zipage_jax.layers.paged_attention import StepInputs, paged_attention_fn, xla_page_size
from zipage_jax.layers.sampler import SamplerFlags, SamplerOutput, SamplingBatch, SamplingRow, sample
from zipage_jax.models.decoder import DecoderFns, split
from zipage_jax.models.loading import LoadedModel


_MIN_TABLE_TOKENS = 64  # 128 cost ~7% at batch 64 (more tokens gathered per row)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("fns", "params_def", "flags", "backend", "tp"),
                   donate_argnames=("kv",))
def _forward_and_sample(fns: DecoderFns, params_def, param_leaves: list[jax.Array], kv: KVState, inputs: StepInputs,
                        sampling: SamplingBatch, *, flags: SamplerFlags, backend: str,
                        tp: TensorParallel | None) -> tuple[KVState, SamplerOutput]:
    # params travel as a flat list: flattening the nnx.State on every call costs ~1 ms of host time
    params = jax.tree.unflatten(params_def, param_leaves)
    hidden, kv = fns.forward(params, inputs.tokens, inputs.positions, paged_attention_fn(inputs, backend, tp), kv)
    last = jnp.take_along_axis(hidden, inputs.last_index[:, None, None], axis=1)[:, 0]  # [B, E]
    return (kv if tp is None else tp.constrain_kv(kv)), sample(fns.logits(params, last), sampling, flags)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "tp"), donate_argnames=("kv",))
def _compress(kv: KVState, block_tables, num_blocks, query_ids, compressed, target_tables, *,
              cfg: CompressionConfig, backend: str, tp: TensorParallel | None) -> KVState:
    def step(kv: KVState, block_tables, num_blocks, query_ids, compressed, target_tables) -> KVState:
        queries = list(kv.queries)
        if tp is not None:
            queries, query_ids = tp.group_queries(queries, query_ids)
        k, v, scores = compress(list(kv.k), list(kv.v), None if kv.scores is None else list(kv.scores), queries,
                                block_tables, num_blocks, query_ids, compressed, target_tables, cfg, backend)
        return kv._replace(k=tuple(k), v=tuple(v), scores=None if scores is None else tuple(scores))

    if tp is not None:  # each shard compresses its own kv heads
        step = tp.per_shard_kv(step, kv, num_replicated=5)
    return step(kv, block_tables, num_blocks, query_ids, compressed, target_tables)


@dataclass
class StepResult:
    chunk: Chunk
    token_id: int
    logprob: float
    top_ids: np.ndarray  # [N]
    top_logprobs: np.ndarray  # [N]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, num_blocks: int, num_query_slots: int):
        self.config = config
        loaded, self.tp = shard_model(loaded, config.tensor_parallel_size)
        self.model_config = mc = loaded.config
        self.fns, params = split(loaded.model)
        if self.tp is not None:
            params = self.tp.place_params(params)
        self.param_leaves, self.params_def = jax.tree.flatten(params)
        self.block_size = config.kvcache_block_size
        self.query_cache_len = config.query_cache_len
        self.num_query_slots = num_query_slots
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        backend = config.attention_backend
        if backend == "auto":
            backend = "pallas" if jax.default_backend() == "gpu" else "xla"
        self.backend = backend
        make_kv = functools.partial(
            KVState.zeros,
            num_layers=mc.num_layers, num_blocks=num_blocks, block_size=self.block_size,
            num_kv_heads=mc.num_kv_heads, num_heads=mc.num_heads, head_dim=mc.head_dim,
            num_query_slots=num_query_slots, query_cache_len=self.query_cache_len,
            dtype=loaded.model.dtype, global_score=config.use_global_score,
        )
        self.kv = make_kv() if self.tp is None else self.tp.make_kv(make_kv)
        self.compress_seconds = 0.0  # only measured when compaction is synchronous
        # Asynchronous (default): a compaction is dispatched and the host goes on to the next
        # decode at once. Off (or profiling): the host waits for each compaction and times it.
        self.profile_compress = not config.enable_async_compress

    @property
    def params(self):
        """The parameters as an nnx.State (the jitted step takes them flat)."""
        return jax.tree.unflatten(self.params_def, self.param_leaves)

    # -- compression ----------------------------------------------------------------------

    def compress(self, plans: list[CompressionPlan]) -> None:
        """One jitted compaction per (budget, eviction policy) among `plans`."""
        groups: dict[tuple[int, str], list[CompressionPlan]] = {}
        for plan in plans:
            policy = plan.seq.params.eviction_policy or self.config.eviction_policy
            groups.setdefault((plan.seq.budget_blocks, policy), []).append(plan)
        for (budget_blocks, policy), group in groups.items():
            cfg = dataclasses.replace(self.config.compression(budget_blocks), eviction_policy=policy)
            self._compress_group(cfg, group)

    def _compress_group(self, cfg: CompressionConfig, plans: list[CompressionPlan]) -> None:
        b = bucket(len(plans))
        w = bucket(max(len(p.source_table) for p in plans))
        tables = np.full((b, w), DUMMY_BLOCK, np.int32)
        targets = np.full((b, cfg.budget_blocks + 1), DUMMY_BLOCK, np.int32)
        num_blocks = np.zeros(b, np.int32)
        query_ids = np.full(b, self.num_query_slots, np.int32)  # the padding row
        compressed = np.zeros(b, bool)
        for i, plan in enumerate(plans):
            tables[i, :len(plan.source_table)] = plan.source_table
            targets[i] = plan.target_table
            num_blocks[i] = len(plan.source_table)
            query_ids[i] = plan.seq.query_slot
            compressed[i] = plan.seq.compressed
        start = time.perf_counter()
        self.kv = _compress(self.kv, tables, num_blocks, query_ids, compressed, targets, cfg=cfg,
                            backend=self.backend, tp=self.tp)
        if self.profile_compress:
            jax.block_until_ready(self.kv)
            self.compress_seconds += time.perf_counter() - start

    # -- forward --------------------------------------------------------------------------

    def run(self, chunks: list[Chunk], rows: list[SamplingRow]) -> list[StepResult]:
        """Prefill chunks and decodes of one step; returns one result per chunk, in order."""
        by_kind = {True: [], False: []}
        for i, chunk in enumerate(chunks):
            by_kind[chunk.num_tokens == 1].append(i)
        pending = []
        for is_decode, idx in by_kind.items():
            if idx:
                out = self._dispatch([chunks[i] for i in idx], [rows[i] for i in idx])
                pending.append((idx, out))
        results: list[StepResult | None] = [None] * len(chunks)
        for idx, out in pending:
            out = jax.device_get(out)
            for row, i in enumerate(idx):
                results[i] = StepResult(chunks[i], int(out.token_ids[row]), float(out.logprobs[row]),
                                        out.top_ids[row], out.top_logprobs[row])
        return results

    def _dispatch(self, chunks: list[Chunk], rows: list[SamplingRow]) -> SamplerOutput:
        inputs = self._inputs(chunks)
        sampling, flags = SamplingBatch.build(rows, inputs.tokens.shape[0])
        self.kv, out = _forward_and_sample(self.fns, self.params_def, self.param_leaves, self.kv, inputs, sampling,
                                           flags=flags, backend=self.backend, tp=self.tp)
        return out

    def _inputs(self, chunks: list[Chunk]) -> StepInputs:
        bs, ql = self.block_size, self.query_cache_len
        # the XLA path attends over pages of the pool, the Pallas kernel over whole blocks
        page = xla_page_size(bs) if self.backend == "xla" else bs
        pages_per_block = bs // page
        b = bucket(len(chunks))
        c = bucket(max(ch.num_tokens for ch in chunks), 1 if all(ch.num_tokens == 1 for ch in chunks) else 16)
        # at least _MIN_TABLE_TOKENS per row, so a short generation does not compile one step per width
        w = bucket(max(-(-(ch.seq.num_kv_slots + ch.num_tokens) // page) for ch in chunks),
                   max(1, _MIN_TABLE_TOKENS // page))
        pad_query = self.num_query_slots * ql
        caches_queries = any(ch.seq.query_slot is not None for ch in chunks)
        tokens = np.zeros((b, c), np.int32)
        positions = np.zeros((b, c), np.int32)
        slots = np.full((b, c), DUMMY_BLOCK * bs, np.int32)
        query_index = np.full((b, c), pad_query, np.int32) if caches_queries else None
        tables = np.full((b, w), DUMMY_BLOCK, np.int32)
        kv_lens = np.zeros((b, c), np.int32)
        last_index = np.zeros(b, np.int32)
        for row, ch in enumerate(chunks):
            seq, n = ch.seq, ch.num_tokens
            table = np.asarray(seq.block_table, np.int32)
            phys = seq.num_kv_slots + np.arange(n)
            tokens[row, :n] = seq.token_ids[ch.start:ch.start + n]
            positions[row, :n] = np.arange(ch.start, ch.start + n)
            slots[row, :n] = table[phys // bs] * bs + phys % bs
            pages = (table[:, None] * pages_per_block + np.arange(pages_per_block)).reshape(-1)
            used = -(-(seq.num_kv_slots + n) // page)
            tables[row, :used] = pages[:used]
            kv_lens[row, :n] = phys + 1
            last_index[row] = n - 1
            if seq.query_slot is not None:
                offset = phys % bs - (bs - ql)
                query_index[row, :n] = np.where(offset >= 0, seq.query_slot * ql + offset, pad_query)
        return StepInputs(tokens, positions, slots, query_index, tables, kv_lens, last_index)
