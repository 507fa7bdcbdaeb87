"""Build a Decoder from named arrays (ours or transformers'), and flatten it back."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zipage_jax.models.config import ModelConfig
from zipage_jax.models.decoder import Decoder


def param_key(path: tuple) -> str:
    """("layers", 3, "self_attn", "qkv_proj", "kernel") -> "layers.3.self_attn.qkv_proj.kernel"."""
    return ".".join(str(p) for p in path)


@functools.lru_cache(maxsize=8)
def _abstract(cfg: ModelConfig, dtype: jnp.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The decoder's graph and parameter shapes."""
    return nnx.split(Decoder(cfg, dtype=dtype, rngs=None))


def param_shapes(cfg: ModelConfig, dtype: jnp.dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """param_key -> shape and dtype, placed on the default device."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's (multi-process runs)
    return {
        param_key(path): jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=device)
        for path, var in nnx.to_flat_state(_abstract(cfg, dtype)[1])
    }


def decoder_from_flat(cfg: ModelConfig, dtype: jnp.dtype, flat: Mapping[str, np.ndarray]) -> Decoder:
    """flat: param_key -> array of exactly the decoder's parameter shapes (cast to `dtype`)."""
    graphdef, state = _abstract(cfg, dtype)
    expected = {param_key(path): (path, var) for path, var in nnx.to_flat_state(state)}
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {', '.join(missing[:8])}")
    unexpected = sorted(set(flat) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:8])}")
    leaves = []
    for key, (path, var) in expected.items():
        value = flat[key]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"parameter {key} has shape {tuple(value.shape)}, expected {tuple(var.shape)}")
        leaves.append((path, var.replace(jnp.asarray(value, dtype=var.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def flat_params(model: Decoder) -> dict[str, jax.Array]:
    """The inverse of decoder_from_flat."""
    return {param_key(path): var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, num_kv_heads: int) -> jax.Array:
    """q [..., Hq * D], k, v [..., Hkv * D] (kernels or biases) -> qkv_proj's [..., Hkv * (G + 2) * D]:
    per kv head, its G query heads, then its k head, then its v head."""
    lead = q.shape[:-1]
    groups = [jnp.reshape(a, (*lead, num_kv_heads, -1)) for a in (q, k, v)]  # [..., Hkv, G * D | D | D]
    return jnp.concatenate(groups, axis=-1).reshape(*lead, -1)


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The inverse of fuse_qkv: qkv [..., Hkv * (G + 2) * D] -> q [..., Hq * D], k, v [..., Hkv * D]."""
    lead, G = qkv.shape[:-1], num_heads // num_kv_heads
    groups = qkv.reshape(*lead, num_kv_heads, G + 2, -1)  # [..., Hkv, G + 2, D]
    q, k, v = groups[..., :G, :], groups[..., G, :], groups[..., G + 1, :]
    return q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)


# Mixtral's names for its expert MLPs, as Qwen3-MoE (and transformers' own loader) call them
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
# gpt-oss's router and expert biases by our names (its stacked expert kernels keep theirs)
_GPT_OSS_NAMES = {".mlp.router.": ".mlp.gate.", ".experts.down_proj_bias": ".experts.down_bias"}


def decoder_from_hf(cfg: ModelConfig, dtype: jnp.dtype, tensors: Mapping[str, np.ndarray]) -> Decoder:
    """tensors: transformers names ("model.layers.0.self_attn.q_proj.weight", ...) -> arrays."""
    flat = {}
    for name, value in tensors.items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        key = name.removeprefix("model.")
        for old, new in {"mixtral": _MIXTRAL_NAMES, "gpt_oss": _GPT_OSS_NAMES}.get(cfg.architecture, {}).items():
            key = key.replace(old, new)
        if key.endswith(("_proj.weight", ".mlp.gate.weight")):  # torch Linear [out, in] -> our kernel [in, out]
            key, value = key.removesuffix("weight") + "kernel", value.T
        flat[key] = value
    if cfg.architecture == "gpt_oss":
        _split_gate_up(flat, cfg)
    elif cfg.num_experts:
        _stack_experts(flat, cfg)
    for i, leaf in itertools.product(range(cfg.num_layers), ("kernel", "bias")):
        parts = [f"layers.{i}.self_attn.{p}_proj.{leaf}" for p in "qkv"]
        missing = [p for p in parts if p not in flat]
        if len(missing) == len(parts):  # no biases (no kernels: decoder_from_flat says so)
            continue
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): {', '.join(missing)}")
        flat[f"layers.{i}.self_attn.qkv_proj.{leaf}"] = fuse_qkv(*(flat.pop(p) for p in parts), cfg.num_kv_heads)
    return decoder_from_flat(cfg, dtype, flat)


def _split_gate_up(flat: dict, cfg: ModelConfig) -> None:
    """In place: each layer's gpt-oss `mlp.experts.gate_up_proj` [E, H, 2I] (and `_bias` [E, 2I]), gate and
    up interleaved along the last axis (gate in the even columns), -> gate_proj / up_proj, gate_bias / up_bias."""
    for i, (fused, gate, up) in itertools.product(range(cfg.num_layers), [("gate_up_proj", "gate_proj", "up_proj"),
                                                                        ("gate_up_proj_bias", "gate_bias", "up_bias")]):
        prefix = f"layers.{i}.mlp.experts."
        if prefix + fused not in flat:
            raise ValueError(f"checkpoint is missing parameter model.{prefix}{fused}")
        value = np.asarray(flat.pop(prefix + fused))
        flat[prefix + gate], flat[prefix + up] = value[..., ::2], value[..., 1::2]


def _stack_experts(flat: dict, cfg: ModelConfig) -> None:
    """In place: each layer's `mlp.experts.{j}.{p}_proj.kernel` (j < E) -> `mlp.experts.{p}_proj` [E, in, out]."""
    for i, proj in itertools.product(range(cfg.num_layers), ("gate_proj", "up_proj", "down_proj")):
        parts = [f"layers.{i}.mlp.experts.{j}.{proj}.kernel" for j in range(cfg.num_experts)]
        missing = [p for p in parts if p not in flat]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert parameter(s): {', '.join(missing[:8])}")
        flat[f"layers.{i}.mlp.experts.{proj}"] = np.stack([np.asarray(flat.pop(p)) for p in parts])
