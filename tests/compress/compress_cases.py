"""Random compression batches and a plain numpy loop version of docs/ALGORITHM.md section 4."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_pool import KVPool
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import POLICIES, CompressRows, KVBudget, compress_rows, resolve_budget
from zipage_jax.compress.scoring import score_layer


def scoring(**options) -> CompressionConfig:
    """The engine's scoring options, the global score off unless asked for (the reference's default)."""
    return CompressionConfig(**{"use_global_score": False, **options})


@dataclass(frozen=True)
class CaseConfig:
    """One test case's compression setting: the scoring options, one budget and one policy for
    every sequence of the batch (sink_len 0 and recent_fraction None: the policy's own)."""

    budget_blocks: int
    block_size: int
    query_cache_len: int = 16
    sink_len: int = 0
    eviction_policy: str = "zipage"
    recent_fraction: float = 0.75
    scoring: CompressionConfig = scoring()

    @property
    def budget_tokens(self) -> int:
        return self.budget_blocks * self.block_size

    def budget(self) -> KVBudget:
        """The budget admission would resolve for this setting."""
        policy = POLICIES[self.eviction_policy]
        options = policy.options(self.sink_len or None, self.recent_fraction)
        return resolve_budget(policy, options, self.budget_blocks, self.block_size, self.query_cache_len)

    def rows(self, num_blocks) -> CompressRows:
        """The batch's per-row arrays: padding rows (no blocks) keep nothing."""
        budget = self.budget()
        return compress_rows([budget if b else None for b in num_blocks])


HEAD_DIM = 16
NUM_KV_HEADS = 2


@dataclass
class Case:
    k_pool: np.ndarray  # [NB, BS, Hkv, D] float16; block 0 and unused blocks are NaN
    v_pool: np.ndarray
    score_cache: np.ndarray  # [NB, BS, Hkv] float32 history; NaN where unused
    query_cache: np.ndarray  # [slots, QL, Hq, D] float16
    block_tables: np.ndarray  # [B, W] int32, padded with 0
    num_blocks: np.ndarray  # [B] int32, 0 for padding rows
    query_ids: np.ndarray  # [B] int32
    compressed: np.ndarray  # [B] bool
    target_tables: np.ndarray  # [B, M + 1] int32


def make_case(seed: int, cfg: CaseConfig, group: int, extra_blocks=(0, 0, 2),
              compressed=(False, True, False), padding_rows: int = 1) -> Case:
    """Sequences of `M + 1 + extra` full blocks at shuffled blocks, then padding rows.

    Targets: the first sequence compacts in place; every other one gets a fresh block in
    place of its first block (as for a shared prefix block), the rest in place.
    """
    rng = np.random.default_rng(seed)
    bs, m, ql = cfg.block_size, cfg.budget_blocks, cfg.query_cache_len
    lengths = [m + 1 + e for e in extra_blocks]
    num_seqs = len(lengths)
    batch = num_seqs + padding_rows
    width = max(lengths) + 1  # one padding column for everyone
    num_kv_blocks = 1 + sum(lengths) + num_seqs + 2  # dummy, sequences, fresh targets, unused
    free = list(rng.permutation(np.arange(1, num_kv_blocks)))
    shape = (num_kv_blocks, bs, NUM_KV_HEADS, HEAD_DIM)
    k_pool = np.full(shape, np.nan, np.float16)
    v_pool = np.full(shape, np.nan, np.float16)
    score_cache = np.full(shape[:3], np.nan, np.float32)
    tables = np.zeros((batch, width), np.int32)
    targets = np.zeros((batch, m + 1), np.int32)
    for b, n in enumerate(lengths):
        tables[b, :n] = [free.pop() for _ in range(n)]
        for block in tables[b, :n]:
            k_pool[block] = rng.standard_normal(shape[1:])
            v_pool[block] = rng.standard_normal(shape[1:])
            score_cache[block] = rng.uniform(0.0, 0.02, shape[1:3])
        targets[b] = tables[b, : m + 1]
        if b > 0:
            targets[b, 0] = free.pop()
    slots = batch + 1
    query_cache = rng.standard_normal((slots, ql, NUM_KV_HEADS * group, HEAD_DIM)).astype(np.float16)
    return Case(
        k_pool=k_pool, v_pool=v_pool, score_cache=score_cache, query_cache=query_cache,
        block_tables=tables, num_blocks=np.array(lengths + [0] * padding_rows, np.int32),
        query_ids=rng.permutation(slots)[:batch].astype(np.int32),
        compressed=np.array(list(compressed) + [False] * padding_rows, bool), target_tables=targets,
    )


@dataclass
class SpecResult:
    """Per sequence [Hkv, T] float64 stages (None when off; whole entry None for padding rows)."""

    attn: list
    global_score: list
    pooled: list
    redundancy: list
    final: list
    keep: list
    score_cache: np.ndarray  # after the global-score write-back


_STAGES = ("attn", "global_score", "pooled", "redundancy", "final", "keep")


def spec_scores(case: Case, cfg: CaseConfig) -> SpecResult:
    """docs/ALGORITHM.md section 4, one sequence and one head at a time, in float64."""
    res = SpecResult([], [], [], [], [], [], case.score_cache.astype(np.float64))
    for b, n in enumerate(case.num_blocks):
        stages = _spec_sequence(case, cfg, b, int(n), res.score_cache) if n else (None,) * 6
        for field, value in zip(_STAGES, stages):
            getattr(res, field).append(value)
    return res


def _spec_sequence(case, cfg, b, n, score_cache):
    bs, ql, k = cfg.block_size, cfg.query_cache_len, cfg.budget_tokens
    blocks = case.block_tables[b, :n]
    t_len = n * bs
    keys = case.k_pool[blocks].astype(np.float64).reshape(t_len, NUM_KV_HEADS, HEAD_DIM)
    pos = np.arange(t_len)
    if cfg.eviction_policy == "streaming":
        sinks = cfg.sink_len or 4
        keep = np.broadcast_to((pos < sinks) | (pos >= t_len - (k - sinks)), (NUM_KV_HEADS, t_len))
        return None, None, None, None, None, keep

    queries = case.query_cache[case.query_ids[b]].astype(np.float64)  # [QL, Hq, D]
    group = queries.shape[1] // NUM_KV_HEADS
    attn = np.zeros((NUM_KV_HEADS, t_len))
    for h in range(NUM_KV_HEADS):
        for i in range(ql):
            seen = t_len - bs + (bs - ql + i) + 1  # query i sees the tokens before it
            best = np.zeros(t_len)
            for g in range(group):
                s = keys[:seen, h] @ queries[i, h * group + g] * HEAD_DIM**-0.5
                p = np.exp(s - s.max())
                best[:seen] = np.maximum(best[:seen], p / p.sum())
            attn[h] += best / ql

    score, glob = attn.copy(), None
    if cfg.scoring.use_global_score:
        if cfg.scoring.max_norm:
            score = score / score.max(axis=1, keepdims=True)
        if case.compressed[b]:
            old = min(t_len - bs, cfg.budget_tokens)  # the tokens kept at the last compaction
            history = score_cache[blocks[:-1]].reshape(old, NUM_KV_HEADS).T
            score[:, :old] = np.maximum(score[:, :old], cfg.scoring.decay_factor * history)
        score_cache[blocks] = score.T.reshape(n, bs, NUM_KV_HEADS)
        glob = score.copy()
    pooled = None
    if cfg.scoring.enable_pooling and (cfg.scoring.continues_pooling or not case.compressed[b]):
        r = cfg.scoring.pooling_size // 2
        score = np.array([[row[max(0, t - r): t + r + 1].max() for t in range(t_len)] for row in score])
    if cfg.scoring.enable_pooling:
        pooled = score.copy()
    red = None
    if cfg.scoring.redundancy != "none":
        red = np.stack([_spec_redundancy(keys[:, h], cfg) for h in range(NUM_KV_HEADS)])
        if cfg.scoring.use_global_score and cfg.scoring.max_norm:
            red = red / red.max(axis=1, keepdims=True)
        score = score * cfg.scoring.redundancy_lambda - red * (1 - cfg.scoring.redundancy_lambda)
    final = score.copy()
    final[:, : cfg.sink_len] = np.inf
    final[:, t_len - ql:] = np.inf
    keep = np.zeros_like(final, bool)
    for h in range(NUM_KV_HEADS):
        keep[h, np.argsort(-final[h], kind="stable")[:k]] = True
    return attn, glob, pooled, red, final, keep


def _spec_redundancy(keys, cfg):  # keys: [T, D] -> softmaxed redundancy [T]
    t_len = len(keys)
    unit = keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-6)
    span = cfg.block_size if cfg.scoring.redundancy == "lightning" else t_len
    logits = np.zeros(t_len)
    for start in range(0, t_len, span):
        sim = unit[start: start + span] @ unit[start: start + span].T
        np.fill_diagonal(sim, 0.0)
        for col in range(span):
            rows = np.nonzero(sim[:, col] > cfg.scoring.redundancy_threshold)[0]
            if len(rows):
                sim[rows.max(), col] = 0.0
        logits[start: start + span] = sim.sum(axis=1)
    z = logits / (cfg.scoring.redundancy_temperature * span)
    e = np.exp(z - z.max())
    return e / e.sum()


def score_case(case: Case, cfg: CaseConfig, backend: str = "xla", rows: CompressRows | None = None):
    """score_layer on a case (each row at the case's budget and policy, or `rows`): (stages, score cache)."""
    score_cache = jnp.asarray(case.score_cache) if cfg.scoring.use_global_score else None
    stages, score_cache = _score(
        jnp.asarray(case.k_pool), jnp.asarray(case.v_pool), jnp.asarray(case.query_cache[case.query_ids]),
        jnp.asarray(case.block_tables), jnp.asarray(case.num_blocks), jnp.asarray(case.compressed), score_cache,
        cfg.rows(case.num_blocks) if rows is None else rows, cfg.scoring, backend)
    return jax.tree.map(np.asarray, stages), score_cache


@functools.partial(jax.jit, static_argnames=("cfg", "backend"))
def _score(k_pool, v_pool, queries, block_tables, num_blocks, compressed, score_cache, rows, cfg, backend):
    return score_layer(k_pool, v_pool, queries, block_tables, num_blocks, compressed, score_cache, rows, cfg,
                       backend)


def compress_args(case: Case, cfg: CaseConfig, pools: list | None = None) -> tuple:
    """The arguments of compress.step.compress for a one-layer case (pools: a KVPool list)."""
    nan_free = lambda x: jnp.asarray(np.nan_to_num(x))  # noqa: E731  (compaction copies NaN padding bytes)
    if pools is None:
        pools = [KVPool(nan_free(case.k_pool), nan_free(case.v_pool),
                        scores=nan_free(case.score_cache) if cfg.scoring.use_global_score else None)]
    return (pools, [jnp.asarray(case.query_cache)], jnp.asarray(case.block_tables), jnp.asarray(case.num_blocks),
            jnp.asarray(case.query_ids), jnp.asarray(case.compressed), jnp.asarray(wide_targets(case)),
            cfg.rows(case.num_blocks), cfg.scoring)


def wide_targets(case: Case) -> np.ndarray:
    """The case's target tables [B, M + 1] padded with the dummy block to the tables' width."""
    targets = np.zeros(case.block_tables.shape, np.int32)
    targets[:, :case.target_tables.shape[1]] = case.target_tables
    return targets
