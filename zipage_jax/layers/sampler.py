"""Batched next-token sampling with per-request parameters.

Order per row (HF / vLLM): ban the row's suppress_ids (EOS and stop ids under min_tokens)
and every token its `allowed` bitmask leaves out (a grammar's next-token mask); repetition
penalty (prompt + output tokens), frequency and presence penalties (output tokens); then a
greedy row takes the argmax and a random row divides by its temperature, keeps the tokens that
pass top-k, top-p (over the top-k survivors) and min-p, and draws one of them by inverse CDF
with a single uniform hashed from (seed, step): a seeded request draws the same tokens whatever
batch it is in. A row with a forced token (teacher forcing) outputs it instead.
Log-probabilities come from the raw logits.

Filters work on unnormalised probabilities p = exp(x - max x), so the kept set is
{p >= max(t_top_k, t_top_p, min_p)} (ties at a threshold are all kept). The top-k and top-p
thresholds are read from the `_CANDIDATES` largest p of each row; only the rows whose
threshold lies deeper run an exact bisection over float32 bits. Nothing sorts the vocabulary.

No option is static: every option is a per-row array, and the costly stages (penalties, random
draws, top-k / top-p, log-probabilities) run under `lax.cond` only when some row needs them, so
one compiled program serves every mix of requests. Penalties read per-sequence token counts
kept on the device (`SamplerState`, filled by `record_inputs` from each step's input tokens), so
no token history crosses from the host; the sampled tokens stay on the device as each slot's
`last_token` for the next step's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

MAX_LOGPROBS = 20  # top log-probabilities the sampler returns per row (requests may ask for fewer)
_LANE = 128  # the vocabulary is padded to a multiple; argmax and draws go block then lane
_GROUP = 16  # candidate groups of `largest`
_CANDIDATES = 64  # largest p per row read for top-k / top-p before falling back to bisection
_ONE_BITS = 0x3F800000  # float32 1.0: thresholds are bisected over the bits of [0, 1]
_BISECT_STEPS = 30  # ceil(log2(_ONE_BITS + 1))
_EXACT_ROWS = 8  # rows bisected together when the candidates do not hold their threshold
_WORD_BITS = 32  # tokens per word of the allowed-token bitmask


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary the sampler works over: vocab_size rounded up to a multiple of the lane width."""
    return vocab_size + (-vocab_size % _LANE)


def mask_words(vocab_size: int) -> int:
    """Words of a row's allowed-token bitmask: one bit per token of the padded vocabulary."""
    return padded_vocab(vocab_size) // _WORD_BITS


class SamplerState(NamedTuple):
    """Per-sequence sampling state kept on the device, one row per state slot (+1 padding row)."""

    last_token: jax.Array  # [S + 1] i32, the last token sampled for each slot
    output_counts: jax.Array  # [S + 1, V] i32, occurrences of each token among the outputs
    prompt_mask: jax.Array  # [S + 1, V] bool, token occurs in the prompt

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> "SamplerState":
        return cls(jnp.zeros((num_slots + 1,), jnp.int32), jnp.zeros((num_slots + 1, vocab_size), jnp.int32),
                   jnp.zeros((num_slots + 1, vocab_size), jnp.bool_))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Every option is a per-row value (no static flags): one compiled sampler serves any mix."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32 output tokens so far (the random stream's position)
    suppress_ids: jax.Array  # [B, S] i32 token ids banned this step, -1 = padding
    allowed: jax.Array  # [B, Vp / 32] i32, bit t % 32 of word t // 32 set = token t may be sampled (-1: all)
    forced: jax.Array  # [B] i32 token each row outputs instead of its sample, -1 = none
    wants_logprobs: jax.Array  # [B] bool
    slot: jax.Array  # [B] i32 state slot (padding rows: the padding slot)
    num_prompt: jax.Array  # [B] i32 prompt length: earlier positions count as prompt tokens
    reset: jax.Array  # [B] bool: the row starts its sequence, its slot's state is cleared first
    samples: jax.Array  # [B] bool: the row's logits give its sequence's next token


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32 log_softmax(logits) of the chosen token
    top_ids: jax.Array  # [B, MAX_LOGPROBS] i32, most likely first (zeros unless some row wants them)
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] f32


def record_inputs(state: SamplerState, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                  slot: jax.Array, num_prompt: jax.Array, reset: jax.Array) -> SamplerState:
    """Counts input tokens into their rows' slots (prompt positions into the prompt mask).

    Every token reaches the sampler's history as the input of the step after it was sampled, so
    the next token's penalties see the whole prompt and output without any history sent.
    tokens, positions, valid: [B, C]; slot, num_prompt, reset: [B] (reset clears the slot first).
    """
    cleared = jnp.where(reset, slot, state.last_token.shape[0] - 1)  # the padding slot otherwise
    counts = state.output_counts.at[cleared].set(0)
    prompt = state.prompt_mask.at[cleared].set(False)
    rows = jnp.broadcast_to(slot[:, None], tokens.shape)
    is_output = positions >= num_prompt[:, None]
    ids = jnp.maximum(tokens, 0)
    counts = counts.at[rows, ids].add((valid & is_output).astype(jnp.int32))
    prompt = prompt.at[rows, ids].max(valid & ~is_output)
    return state._replace(output_counts=counts, prompt_mask=prompt)


@jax.jit
def sample(logits: jax.Array, batch: SamplingBatch, state: SamplerState) -> tuple[SamplerOutput, SamplerState]:
    """logits: [B, V] -> one token per row (see the module docstring); the sampling rows' tokens
    become their slots' last_token."""
    if logits.ndim != 2 or logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(f"logits must be [B={batch.temperature.shape[0]}, V], got {logits.shape}")
    vocab = logits.shape[-1]
    if batch.allowed.shape[-1] != mask_words(vocab):
        raise ValueError(f"allowed must be [B, {mask_words(vocab)}] for a vocabulary of {vocab}, "
                         f"got {batch.allowed.shape}")
    raw = pad_vocab(logits)  # [B, Vp]
    x = _suppress(raw, batch.suppress_ids)
    x = lax.cond(jnp.any(batch.allowed != -1), lambda x: _allow(x, batch.allowed), lambda x: x, x)
    penalised = (batch.repetition_penalty != 1) | (batch.presence_penalty != 0) | (batch.frequency_penalty != 0)
    x = lax.cond(jnp.any(penalised), lambda x: _penalise(x, batch, state), lambda x: x, x)
    random = batch.temperature > 0
    token_ids = lax.cond(jnp.any(random), lambda x: _sample_random(x, batch), _argmax, x)
    token_ids = jnp.where(batch.forced >= 0, batch.forced, token_ids)
    lse = jax.nn.logsumexp(raw, axis=-1)  # [B]
    logprobs = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - lse
    def top():
        values, ids = largest(raw, MAX_LOGPROBS)
        return values - lse[:, None], ids

    def nothing():
        shape = (raw.shape[0], MAX_LOGPROBS)
        return jnp.zeros(shape, raw.dtype), jnp.zeros(shape, jnp.int32)

    top_logprobs, top_ids = lax.cond(jnp.any(batch.wants_logprobs), top, nothing)
    written = jnp.where(batch.samples, batch.slot, state.last_token.shape[0] - 1)
    state = state._replace(last_token=state.last_token.at[written].set(token_ids))
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs), state


def pad_vocab(logits: jax.Array) -> jax.Array:
    """logits: [..., V] -> [..., Vp] float32, padded with -inf to a multiple of the lane width."""
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, padded_vocab(logits.shape[-1]) - logits.shape[-1])]
    return jnp.pad(logits.astype(jnp.float32), pad, constant_values=-jnp.inf)


def _suppress(x: jax.Array, suppress_ids: jax.Array) -> jax.Array:
    # x: [B, Vp], suppress_ids: [B, S]; padding entries take min(x, +inf), a no-op
    rows = lax.broadcasted_iota(jnp.int32, suppress_ids.shape, 0)
    fill = jnp.where(suppress_ids >= 0, -jnp.inf, jnp.inf)
    return x.at[rows, jnp.maximum(suppress_ids, 0)].min(fill)


def _allow(x: jax.Array, allowed: jax.Array) -> jax.Array:
    # x: [B, Vp]; allowed: [B, Vp / 32] bit words, token t = bit t % 32 of word t // 32
    bits = (allowed[:, :, None] >> jnp.arange(_WORD_BITS, dtype=jnp.int32)) & 1  # [B, Vp / 32, 32]
    return jnp.where(bits.reshape(x.shape) != 0, x, -jnp.inf)


def _penalise(x: jax.Array, batch: SamplingBatch, state: SamplerState) -> jax.Array:
    # x: [B, Vp]; the slots' counts and prompt masks: [B, V]
    pad = ((0, 0), (0, x.shape[-1] - state.output_counts.shape[-1]))
    counts = jnp.pad(state.output_counts[batch.slot], pad).astype(jnp.float32)
    seen = jnp.pad(state.prompt_mask[batch.slot], pad) | (counts > 0)
    rep = batch.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - batch.frequency_penalty[:, None] * counts - batch.presence_penalty[:, None] * (counts > 0)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum, found block by block (XLA's argmax is slow on CPU)."""
    # x: [B, Vp]
    blocks = _materialise(x).reshape(x.shape[0], -1, _LANE)  # [B, nb, L]
    j = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # [B] first block holding the maximum
    i = jnp.argmax(jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0], axis=-1)
    return (j * _LANE + i).astype(jnp.int32)


def _sample_random(x: jax.Array, batch: SamplingBatch) -> jax.Array:
    # x: [B, Vp] penalised logits
    greedy = batch.temperature == 0  # [B]
    centred = x - jnp.max(x, axis=-1, keepdims=True)  # [B, Vp] <= 0, 0 at the argmax
    p = _materialise(jnp.exp(centred / jnp.where(greedy, 1.0, batch.temperature)[:, None]))  # unnormalised, max 1
    filtered = ~greedy & ((batch.top_k > 0) | (batch.top_p < 1))
    threshold = lax.cond(jnp.any(filtered), lambda: jnp.maximum(batch.min_p, _top_k_p_threshold(
        p, jnp.where(filtered, batch.top_k, 0), jnp.where(filtered, batch.top_p, 1.0))), lambda: batch.min_p)
    keep = jnp.where(greedy[:, None], centred == 0, p >= threshold[:, None])
    u = jnp.where(greedy, 0.0, uniform(batch.seed, batch.step))  # [B] in [0, 1)
    return _draw(jnp.where(keep, p, 0.0), u)


def _draw(weight: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse CDF, block then lane: index i with probability weight_i / sum(weight).

    u = 0 gives the first positive weight (a greedy row's argmax).
    """
    # weight: [B, Vp] >= 0; u: [B] in [0, 1)
    blocks = _materialise(weight).reshape(weight.shape[0], -1, _LANE)  # [B, nb, L]
    block_mass = jnp.sum(blocks, axis=-1)  # [B, nb]
    block_cdf = _cumsum(block_mass)
    target = u * block_cdf[:, -1]  # [B]
    j = _first_above(block_cdf, block_mass, target)
    lanes = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [B, L]
    before = _at(block_cdf, j) - _at(block_mass, j)
    i = _first_above(_cumsum(lanes), lanes, target - before)
    return (j * _LANE + i).astype(jnp.int32)


def _first_above(cdf: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    # cdf, weight: [B, N], target: [B] -> first index with cdf > target, never past the last positive weight
    iota = lax.broadcasted_iota(jnp.int32, cdf.shape, 1)
    last = jnp.max(jnp.where(weight > 0, iota, 0), axis=-1)
    return jnp.minimum(jnp.sum(cdf <= target[:, None], axis=-1), last)


def _top_k_p_threshold(p: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per row, the smallest p kept by top-k then top-p (0 where both are off)."""
    # p: [B, Vp] in [0, 1]; top_k, top_p: [B]
    vocab = p.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    num = min(_CANDIDATES, vocab)
    vals, _ = largest(p, num)  # [B, K] descending
    in_k = lax.broadcasted_iota(jnp.int32, vals.shape, 1) < jnp.where(k_on, top_k, num)[:, None]
    cum = _cumsum(jnp.where(in_k, vals, 0.0))  # [B, K]
    before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # [B, K] mass of the larger candidates
    k_fits = k_on & (top_k <= num)
    mass = jnp.where(k_fits, cum[:, -1], jnp.sum(p, axis=-1))  # top-p renormalises over top-k survivors
    target = top_p * mass
    kept = jnp.sum(in_k & (before < target[:, None]), axis=-1)  # tokens in the nucleus
    t_k = jnp.where(k_fits, _at(vals, top_k - 1), 0.0)
    t_p = jnp.where(p_on, _at(vals, kept - 1), 0.0)
    fits = (~k_on | k_fits) & (~p_on | (cum[:, -1] >= target))
    fast = jnp.maximum(t_k, t_p)
    return _exact_where_needed(p, top_k, top_p, fast, fits)


def _exact_where_needed(p: jax.Array, top_k: jax.Array, top_p: jax.Array, fast: jax.Array,
                        fits: jax.Array) -> jax.Array:
    """`fast` where it fits; elsewhere the bisection, run on just those rows, _EXACT_ROWS at a time."""
    # p: [B, Vp]; top_k, top_p, fast, fits: [B]
    batch = p.shape[0]
    size = min(_EXACT_ROWS, batch)
    rows = jnp.nonzero(~fits, size=-(-batch // size) * size, fill_value=batch)[0]  # padding: batch (dropped)

    def exact_rows(i, out):
        picked = lax.dynamic_slice_in_dim(rows, i * size, size)  # [size]
        safe = jnp.minimum(picked, batch - 1)
        return out.at[picked].set(_exact_threshold(p[safe], top_k[safe], top_p[safe]), mode="drop")

    return lax.fori_loop(0, -(-jnp.sum(~fits) // size), exact_rows, fast)


def _exact_threshold(p: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    # p: [R, Vp]; top_k, top_p: [R] -> [R] the smallest p kept by top-k then top-p
    k_on = (top_k > 0) & (top_k < p.shape[-1])
    p_on = top_p < 1
    zeros = jnp.zeros(top_p.shape, p.dtype)
    t_k = lax.cond(jnp.any(k_on), lambda: jnp.where(
        k_on, _largest_threshold(p, jnp.ones_like(p), top_k.astype(jnp.float32)), 0.0), lambda: zeros)
    top_k_p = jnp.where(p >= t_k[:, None], p, 0.0)
    t_p = lax.cond(jnp.any(p_on), lambda: jnp.where(
        p_on, _largest_threshold(p, top_k_p, top_p * jnp.sum(top_k_p, axis=-1)), 0.0), lambda: zeros)
    return jnp.maximum(t_k, t_p)


def _largest_threshold(p: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the largest t in [0, 1] with sum(weight[p >= t]) >= target (requires target <= sum(weight))."""
    # p, weight: [B, Vp]; target: [B]

    def halve(_, bounds):
        lo, hi = bounds  # [B] i32 float bits; lo always satisfies the condition
        mid = lo + (hi - lo + 1) // 2
        t = lax.bitcast_convert_type(mid, jnp.float32)[:, None]
        ok = jnp.sum(jnp.where(p >= t, weight, 0.0), axis=-1) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros(target.shape, jnp.int32)
    lo, _ = lax.fori_loop(0, _BISECT_STEPS, halve, (lo, jnp.full(target.shape, _ONE_BITS, jnp.int32)))
    return lax.bitcast_convert_type(lo, jnp.float32)


def largest(x: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
    """The num largest entries of each row and their indices, descending.

    lax.top_k over the whole row is slow on CPU; the num largest all lie in the num groups
    of _GROUP with the largest maxima, so top_k runs over group maxima, then those groups.
    """
    # x: [B, Vp]
    b, vocab = x.shape
    x = _materialise(x)
    if num == 0:
        return jnp.zeros((b, 0), x.dtype), jnp.zeros((b, 0), jnp.int32)
    if vocab < 4 * _GROUP * num:
        values, ids = lax.top_k(x, num)
        return values, ids.astype(jnp.int32)
    groups = x.reshape(b, -1, _GROUP)  # [B, G, g]
    _, best = lax.top_k(jnp.max(groups, axis=-1), num)  # [B, num]
    candidates = jnp.take_along_axis(groups, best[:, :, None], axis=1).reshape(b, -1)  # [B, num * g]
    candidate_ids = (best[:, :, None] * _GROUP + jnp.arange(_GROUP)).reshape(b, -1)
    values, pos = lax.top_k(candidates, num)
    return values, jnp.take_along_axis(candidate_ids, pos, axis=-1).astype(jnp.int32)


def uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One uniform in [0, 1) per row from its (seed, step), counter-based: the same whatever the
    batch. Two rounds of the murmur3 finaliser (a bijection of uint32) mix the seed and the step;
    the top 24 bits give the float. (jax.random's threefry adds compile time to every program.)"""
    # seed: [B] u32; step: [B] i32
    h = _fmix32(seed ^ jnp.uint32(0x9E3779B9))
    h = _fmix32(h ^ (step.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B) + jnp.uint32(0xC2B2AE35)))
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _cumsum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis as one product with a triangular matrix (XLA's
    CPU cumsum is an associative scan: dozens of ops, slow to compile)."""
    n = x.shape[-1]
    upper = jnp.triu(jnp.ones((n, n), x.dtype))  # upper[i, j] = i <= j
    return jnp.dot(x, upper, precision=lax.Precision.HIGHEST)


def _materialise(x: jax.Array) -> jax.Array:
    # XLA on CPU otherwise fuses the producer (exp, penalties) into every consumer and recomputes it
    return lax.optimization_barrier(x)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    # x: [B, K], index: [B] -> [B], clipped into range
    return jnp.take_along_axis(x, jnp.clip(index, 0, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
