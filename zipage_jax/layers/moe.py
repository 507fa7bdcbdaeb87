"""A mixture-of-experts MLP: a softmax router picks k experts per token, and the experts run as
grouped matrix products over the token rows sorted by expert.

The N * k (token, expert) assignments are sorted by expert; a grouped matrix product then
multiplies each expert's contiguous rows by that expert's weights (gate/up, then down), so shapes
stay static (N * k rows, group sizes from a bincount) and no expert sees tokens not routed to it.
The rows go back to their tokens in one weighted segment sum.

The grouped product is `jax.lax.ragged_dot` on accelerators. On CPU, JAX lowers ragged_dot to
one masked dense product per group (every expert on every row); there the rows go in tiles
instead: each expert's rows cut into tiles of a static size (at most one partly filled tile per
expert), each tile multiplied by its expert's weights, the rows kept in tiles from the gather of
the tokens to the weighted sum.

Expert weights are stacked: gate_proj, up_proj [E, hidden, width], down_proj [E, width, hidden].
gpt-oss adds per-expert biases (`ExpertBiases`: gate, up [E, width], down [E, hidden]) and its
clamped SwiGLU (`ClampedSwiGLU`); without them the path is the plain SwiGLU MLP.

Under expert parallelism (`expert_parallel_mlp`) the E axis is split over a device mesh: a
shard_map gives each device its own experts' rows (another device's experts' rows are dropped
there, the shapes staying static) and one float32 all-reduce adds the devices' outputs. With
top-2 routing that sum is exact: each token gets at most two non-zero terms. In tiles, a device
still runs as many tiles as the worst routing needs (all rows to its experts): on CPU expert
parallelism splits the experts' memory, not their work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


class ExpertBiases(NamedTuple):
    """Per-expert biases: gate, up [E, width] (added to those products), down [E, hidden]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""

    limit: float
    alpha: float = 1.702

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def route(logits: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> (weights [N, k] float32, experts [N, k] int32): the softmax (in
    float32) over all experts, its top k, optionally renormalised to sum to 1."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                down_proj: jax.Array, *, tiled: bool | None = None, biases: ExpertBiases | None = None,
                glu: ClampedSwiGLU | None = None) -> jax.Array:
    """x [N, hidden], weights / experts [N, k] -> sum over k of weight * expert's SwiGLU MLP(x): [N, hidden].
    An expert id >= E adds nothing (expert parallelism: an expert held by another device).
    tiled: the grouped products as tiles (default: on CPU) or as jax.lax.ragged_dot.
    biases, glu: gpt-oss's expert biases and clamped SwiGLU (None: none, plain SwiGLU)."""
    tile = _tile_rows(experts.size, gate_proj.shape[0])
    return _grouped_sum(x, weights, experts, gate_proj, up_proj, down_proj, tiled, tile, biases,
                        glu).astype(x.dtype)


def expert_parallel_mlp(mesh: Mesh, x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                        up_proj: jax.Array, down_proj: jax.Array, *, tiled: bool | None = None,
                        biases: ExpertBiases | None = None, glu: ClampedSwiGLU | None = None) -> jax.Array:
    """grouped_mlp with the experts' E axis split over all of `mesh`'s axes (x, weights and
    experts replicated; biases split like the weights): device d runs experts [d * E/n, (d + 1) * E/n);
    one all-reduce."""
    axes = mesh.axis_names
    tile = _tile_rows(experts.size, gate_proj.shape[0])  # one device's tiles: the same products per expert

    def local(x, weights, experts, gate_proj, up_proj, down_proj, biases):
        held = gate_proj.shape[0]
        ids = experts - jax.lax.axis_index(axes) * held
        ids = jnp.where((ids >= 0) & (ids < held), ids, held)  # held: another device's expert
        return jax.lax.psum(_grouped_sum(x, weights, ids, gate_proj, up_proj, down_proj, tiled, tile, biases, glu),
                            axes)

    split = jax.shard_map(local, mesh=mesh, in_specs=(P(),) * 3 + (P(axes),) * 4, out_specs=P())
    return split(x, weights, experts, gate_proj, up_proj, down_proj, biases).astype(x.dtype)


def _grouped_sum(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                 down_proj: jax.Array, tiled: bool | None, tile: int, biases: ExpertBiases | None = None,
                 glu: ClampedSwiGLU | None = None) -> jax.Array:
    """grouped_mlp in float32, before the cast, in tiles of `tile` rows."""
    N, k = experts.shape
    flat = experts.reshape(-1)  # assignment a = token * k + slot
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, ids >= E last
    sizes = jnp.bincount(flat, length=gate_proj.shape[0]).astype(jnp.int32)  # ids >= E not counted
    tokens, row_weights = order // k, weights.reshape(-1)[order]  # per row: [N * k]
    if tiled is None:
        tiled = jax.default_backend() == "cpu"
    if tiled:
        group, slots, valid = _tiles(sizes, N * k, tile)
        tokens = jnp.where(valid, tokens[slots], N)  # per row: [tiles, tile]; N: no row (dropped)
        row_weights = jnp.where(valid, row_weights[slots], 0.0)

        def matmul(h: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.einsum("tmk,tkn->tmn", h, w[group])

        def bias(b: jax.Array) -> jax.Array:  # [E, n] -> per tile [tiles, 1, n]
            return b[group][:, None]
    else:
        tokens = jnp.where(jnp.arange(N * k) < sizes.sum(), tokens, N)  # rows past every group: dropped

        def matmul(h: jax.Array, w: jax.Array) -> jax.Array:
            return jax.lax.ragged_dot(h, w, sizes)

        def bias(b: jax.Array) -> jax.Array:  # [E, n] -> per row [N * k, n] (dropped rows: any expert's)
            return b[jnp.minimum(flat[order], b.shape[0] - 1)]
    rows = x.at[tokens].get(mode="fill", fill_value=0)  # rows: [..., hidden]
    gate, up = matmul(rows, gate_proj), matmul(rows, up_proj)
    if biases is not None:
        gate, up = gate + bias(biases.gate), up + bias(biases.up)
    h = (_swiglu if glu is None else glu)(gate, up)
    out = matmul(h, down_proj)
    if biases is not None:
        out = out + bias(biases.down)
    out = out.astype(jnp.float32) * row_weights[..., None]
    return jax.ops.segment_sum(out.reshape(-1, x.shape[1]), tokens.reshape(-1), num_segments=N)


def _tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: about a group's share of the rows, a power of two in [8, 128]."""
    return min(128, max(8, 1 << max(0, (rows // groups).bit_length() - 1)))


def _tiles(sizes: jax.Array, rows: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`rows` rows in groups of `sizes` (in order) cut into tiles of `tile` rows, no tile across two
    groups -> (group [tiles], row [tiles, tile], valid [tiles, tile]); a static number of tiles,
    the most any grouping needs (the unused ones and rows past a group's end are not valid)."""
    count = -(-rows // tile) + sizes.shape[0] - 1
    ends = jnp.cumsum(sizes)
    per_group = -(-sizes // tile)
    tile_ends = jnp.cumsum(per_group)
    t = jnp.arange(count)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), sizes.shape[0] - 1)
    first = ends[group] - sizes[group] + (t - tile_ends[group] + per_group[group]) * tile
    row = first[:, None] + jnp.arange(tile)
    valid = (row < ends[group][:, None]) & (t < tile_ends[-1])[:, None]
    return group, jnp.minimum(row, rows - 1), valid


def grouped_mlp_reference(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_proj: jax.Array,
                          up_proj: jax.Array, down_proj: jax.Array, *, biases: ExpertBiases | None = None,
                          glu: ClampedSwiGLU | None = None) -> jax.Array:
    """grouped_mlp computed densely: every expert on every token, then weighted by the routing (tests)."""
    E = gate_proj.shape[0]
    gate, up = jnp.einsum("nh,ehi->eni", x, gate_proj), jnp.einsum("nh,ehi->eni", x, up_proj)
    if biases is not None:
        gate, up = gate + biases.gate[:, None], up + biases.up[:, None]
    every = jnp.einsum("eni,eih->enh", (_swiglu if glu is None else glu)(gate, up), down_proj)
    if biases is not None:
        every = every + biases.down[:, None]
    every = every.astype(jnp.float32)  # every: [E, N, hidden]
    dense = (jax.nn.one_hot(experts, E, dtype=jnp.float32) * weights[..., None]).sum(axis=1)  # [N, E]
    return jnp.einsum("enh,ne->nh", every, dense).astype(x.dtype)
