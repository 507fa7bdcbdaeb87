"""Tensor parallelism over a one-axis `tp` device mesh.

Megatron-style layout, expressed as NamedShardings so XLA's SPMD partitioner does the rest:
  qkv_proj, gate/up_proj     kernel [E, out] split on out, bias on out (qkv_proj's columns are
                             grouped per kv head: a shard holds whole kv heads and their query heads)
  o_proj, down_proj          kernel [in, E] split on in; their outputs are the only all-reduces
  experts' gate/up_proj      [experts, E, width] split on width, down_proj [experts, width, E]
                             split on width (each expert's MLP split like the dense one); router replicated
                             (enable_expert_parallel: all three split on experts instead, each device
                             holding whole experts, run under shard_map by layers/moe.py)
  embeddings, norms, biases of o/down                   replicated
  KV pool k, v [NB, BS, Hkv, D] (int4: D / 2 bytes)      split on Hkv
  score cache, quantized pools' scales [NB, BS, Hkv]     split on Hkv
  int4 pools' group scales [NB, BS, Hkv, D / 32]         split on Hkv
  query cache [slots + 1, QL, Hq, D]                     split on Hq
  sampler state                                          replicated
Shard s holds kv heads [s*Hkv/N, (s+1)*Hkv/N) and query heads [s*Hq/N, (s+1)*Hq/N): exactly
the query heads of its kv heads (GQA groups are contiguous), so attention is local. When
Hkv < N (and N divides Hq and Hkv divides N) every kv head is repeated N/Hkv times, as vLLM
does: the model becomes one with N kv heads, one per shard.

Compression runs under shard_map: every shard scores, selects and compacts its own kv heads
(scores and top-k are per kv head), so it has no collectives, except with repeated kv heads:
then each copy gathers its whole query group's cached queries of the sequences being
compressed (never the pool), so every copy keeps the tokens one device keeps. The Pallas decode kernel
also needs shard_map (a pallas_call cannot be partitioned), its pools' scales split like the
pools; the XLA attention is partitioned by XLA along the head axis.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.kv_pool import KVPool
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import LoadedModel
from zipage_jax.models.weights import decoder_from_flat, flat_params, fuse_qkv, split_qkv

TP = "tp"
_COLUMN_PARALLEL = {"qkv_proj", "gate_proj", "up_proj"}
_ROW_PARALLEL = {"o_proj", "down_proj"}
_HEADS = P(None, None, TP, None)  # k, v pools and the query cache: [N0, N1, heads, D]
_TOKEN_HEADS = P(None, None, TP)  # score cache and quantized pools' scales [NB, BS, Hkv, *groups]

logger = logging.getLogger("zipage_jax")


@dataclass(frozen=True)
class TensorParallel:
    """The mesh and the placement rules; hashable, so it is a static argument of the jitted steps."""

    mesh: Mesh
    kv_repeats: int = 1  # copies of each of the checkpoint's kv heads (> 1 when it has fewer than `size`)
    expert_parallel: bool = False  # experts split by expert, not by width

    def param_shardings(self, params):
        """A NamedSharding per parameter of an nnx.State, chosen by module name."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: NamedSharding(self.mesh, param_spec(path, self.expert_parallel)), params)

    def place_params(self, params):
        return _place(params, self.param_shardings(params))

    def kv_specs(self, kv: KVState) -> KVState:
        def pool_spec(pool: KVPool) -> KVPool:
            per_token = lambda a: None if a is None else _TOKEN_HEADS  # noqa: E731
            return KVPool(_HEADS, _HEADS, per_token(pool.k_scales), per_token(pool.v_scales), per_token(pool.scores),
                          per_token(pool.positions))

        return KVState(pools=tuple(pool_spec(p) for p in kv.pools), queries=tuple(_HEADS for _ in kv.queries))

    def kv_shardings(self, kv: KVState) -> KVState:
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), self.kv_specs(kv),
                                      is_leaf=lambda x: isinstance(x, P))

    def make_kv(self, make: Callable[[], KVState]) -> KVState:
        """Builds the zero KV state directly sharded (the whole pool never sits on one device)."""
        return jax.jit(make, out_shardings=self.kv_shardings(jax.eval_shape(make)))()

    def replicated_shardings(self, tree):
        return jax.tree_util.tree_map(lambda _: NamedSharding(self.mesh, P()), tree)

    def replicate(self, tree):
        """Every device holds the whole of `tree` (the sampler's state)."""
        return _place(tree, self.replicated_shardings(tree))

    def constrain_kv(self, kv: KVState) -> KVState:
        """Inside jit: pins the returned KV state to its input layout (steady jit cache keys)."""
        return jax.lax.with_sharding_constraint(kv, self.kv_shardings(kv))

    def per_shard_kv(self, fn: Callable, kv: KVState, shard_out: bool = False) -> Callable:
        """shard_map of `fn(kv, *replicated) -> kv` (with `shard_out`, `-> (kv, x)`, each shard's x
        stacked along x's first axis): fn sees each shard's heads only; every other argument (a
        pytree) is replicated."""
        specs = self.kv_specs(kv)
        out_specs = (specs, P(TP)) if shard_out else specs

        def run(kv: KVState, *replicated):
            # check_vma off: Pallas calls inside do not carry varying-axis types.
            return jax.shard_map(fn, mesh=self.mesh, in_specs=(specs,) + (P(),) * len(replicated),
                                 out_specs=out_specs, check_vma=False)(kv, *replicated)

        return run

    def group_queries(self, queries: list[jax.Array], query_ids: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        """Inside per_shard_kv: the cached queries each shard's kv heads are scored with.

        A repeated kv head must be scored by its whole query group, as on one device, but its
        shard holds only G / kv_repeats of those heads: gather the group's queries of the
        sequences being compressed (queries per layer [slots + 1, QL, Hq/N, D] -> [B, QL, G, D])."""
        if self.kv_repeats == 1:
            return queries, query_ids
        local_heads = queries[0].shape[2]
        group = local_heads * self.kv_repeats
        start = jax.lax.axis_index(TP) // self.kv_repeats * group
        gathered = []
        for q in queries:
            full = jax.lax.all_gather(q[query_ids], TP, axis=2, tiled=True)  # [B, QL, Hq, D]
            gathered.append(jax.lax.dynamic_slice_in_dim(full, start, group, axis=2))
        return gathered, jnp.arange(query_ids.shape[0], dtype=query_ids.dtype)

    def per_shard_decode(self, kernel: Callable) -> Callable:
        """shard_map of a decode kernel(q [B, Hq, D], k_pool, v_pool, block_tables, lens, **scales) -> [B, Hq, D];
        scales: k_scales, v_scales [NB, BS, Hkv] (int4: [NB, BS, Hkv, D / 32]) of a quantized pool, split on Hkv
        like the pools, and sinks [Hq] (attention sinks) split like q's heads."""
        q_spec = P(None, TP, None)

        def run(q, k_pool, v_pool, block_tables, lens, **scales):
            names = tuple(scales)

            def local(q, k_pool, v_pool, block_tables, lens, *scale_arrays):
                return kernel(q, k_pool, v_pool, block_tables, lens, **dict(zip(names, scale_arrays)))

            # the scales split on Hkv like the pools; attention sinks [Hq] like q's heads
            kwarg_specs = tuple(P(TP) if name == "sinks" else _TOKEN_HEADS for name in names)
            in_specs = (q_spec, _HEADS, _HEADS, P(), P()) + kwarg_specs
            return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
                q, k_pool, v_pool, block_tables, lens, *scales.values())

        return run

def param_spec(path: tuple, expert_parallel: bool = False) -> P:
    """PartitionSpec of the parameter at an nnx.State path (..., module, "kernel" | "bias")."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    names = [n for n in names if n != "value"]
    module, leaf = names[-2], names[-1]
    if module == "experts" and leaf.endswith("_bias"):  # gpt-oss's stacked expert biases [experts, out]
        return P(TP, None) if expert_parallel else P() if leaf == "down_bias" else P(None, TP)
    if module == "experts":  # stacked expert kernels [experts, in, out]
        if expert_parallel:
            return P(TP, None, None)
        return P(None, TP, None) if leaf in _ROW_PARALLEL else P(None, None, TP)
    if module in _COLUMN_PARALLEL:
        return P(None, TP) if leaf == "kernel" else P(TP)
    if module in _ROW_PARALLEL and leaf == "kernel":
        return P(TP, None)
    return P()


def shard_model(loaded: LoadedModel, size: int, expert_parallel: bool = False
                ) -> tuple[LoadedModel, TensorParallel | None]:
    """The model as the runner shards it (kv heads repeated if need be) and the mesh; (loaded, None) for size 1.
    expert_parallel: a mixture of experts' experts split by expert (no effect on a dense model)."""
    if expert_parallel and not loaded.config.num_experts:
        logger.info("enable_expert_parallel has no effect: the model has no experts")
    expert_parallel = expert_parallel and bool(loaded.config.num_experts)
    ready = shard_ready(loaded, size, expert_parallel)
    tp = tensor_parallel(size)
    if tp is None:
        return ready, None
    tp = dataclasses.replace(tp, kv_repeats=ready.config.num_kv_heads // loaded.config.num_kv_heads,
                             expert_parallel=expert_parallel)
    return (with_expert_mesh(ready, tp.mesh) if expert_parallel else ready), tp


def with_expert_mesh(loaded: LoadedModel, mesh: Mesh) -> LoadedModel:
    """A copy of the model (the same arrays) whose expert layers run split by expert over `mesh`."""
    model = nnx.merge(*nnx.split(loaded.model))
    for layer in model.layers:
        layer.mlp.experts.mesh = mesh
    return dataclasses.replace(loaded, model=model)


def tensor_parallel(size: int) -> TensorParallel | None:
    """The `tp` mesh over the first `size` devices (all processes'); None for size 1."""
    if size == 1:
        return None
    devices = jax.devices()
    if size > len(devices):
        hint = (f"; on CPU start Python with XLA_FLAGS=--xla_force_host_platform_device_count={size}"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"tensor_parallel_size {size} needs {size} devices, but JAX sees {len(devices)} "
                         f"{jax.default_backend()} device(s){hint}")
    if jax.process_count() > 1 and size != len(devices):
        raise ValueError(f"with {jax.process_count()} processes, tensor_parallel_size must span all "
                         f"{len(devices)} devices (every process runs the engine on its own devices), got {size}")
    return TensorParallel(Mesh(np.array(devices[:size]), (TP,)))


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> int:
    """ValueError unless the model splits over `size` shards; returns how often each kv head is repeated.
    expert_parallel: the experts are split whole (their number must divide, not their width)."""
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the number of attention heads "
                         f"({cfg.num_heads}); try one of {_divisors(cfg.num_heads)}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and the {cfg.num_kv_heads} kv heads must divide one another "
                         f"(kv heads are split when there are more, repeated when there are fewer)")
    if expert_parallel and cfg.num_experts:
        if cfg.num_experts % size:
            raise ValueError(f"enable_expert_parallel: tensor_parallel_size {size} must divide the number of "
                             f"experts ({cfg.num_experts}); try one of {_divisors(cfg.num_experts)}")
    elif cfg.mlp_width % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the MLP intermediate size "
                         f"({cfg.mlp_width})")
    return max(1, size // cfg.num_kv_heads)


def shard_ready(loaded: LoadedModel, size: int, expert_parallel: bool = False) -> LoadedModel:
    """The model to shard over `size` devices: itself, or a copy with each kv head repeated.

    Repeating kv head h as heads h*r .. h*r + r-1 keeps every query head with its own kv
    head (query head i used kv head i // G; it now uses i // (G/r), a copy of it)."""
    repeats = check_divisible(loaded.config, size, expert_parallel)
    if repeats == 1:
        return loaded
    cfg = dataclasses.replace(loaded.config, num_kv_heads=loaded.config.num_kv_heads * repeats)
    logger.info("tensor_parallel_size %d > %d kv heads: each kv head is repeated %d times", size,
                loaded.config.num_kv_heads, repeats)
    flat = {}
    for key, value in flat_params(loaded.model).items():
        if key.endswith(("qkv_proj.kernel", "qkv_proj.bias")):
            q, k, v = split_qkv(value, cfg.num_heads, loaded.config.num_kv_heads)
            lead = value.shape[:-1]
            k, v = (a.reshape(*lead, -1, cfg.head_dim).repeat(repeats, axis=-2).reshape(*lead, -1) for a in (k, v))
            value = fuse_qkv(q, k, v, cfg.num_kv_heads)  # q head i now joins copy i // (G/r) of its kv head
        flat[key] = value
    return dataclasses.replace(loaded, config=cfg, model=decoder_from_flat(cfg, loaded.model.dtype, flat))


def _place(tree, shardings):
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    # Every process holds the whole (identical) value; each builds its own devices' shards.
    def place(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree_util.tree_map(place, tree, shardings)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
