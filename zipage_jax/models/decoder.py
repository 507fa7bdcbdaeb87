"""One Flax NNX decoder for Llama, Qwen2, Qwen3, their mixtures of experts Qwen3-MoE and Mixtral,
Gemma 3's text model and gpt-oss (GQA, tied or untied embeddings).

Module and parameter names mirror transformers' (`layers[i].self_attn.o_proj`, ...) so the
checkpoint mapping in weights.py is mechanical; a Linear stores `kernel: [in, out]`. One is
fused: `self_attn.qkv_proj` holds q/k/v_proj (one matmul instead of three), its columns grouped
per kv head: its G query heads, its k head, its v head, so a column shard over whole kv heads
holds their query heads too (tensor parallel); weights.fuse_qkv builds it. gate/up_proj stay
apart: fusing them was slower at large batches on CPU. A mixture of experts replaces each
layer's MLP by `mlp.gate` (the router) and `mlp.experts.{gate,up,down}_proj`, every expert's
kernel stacked: [E, in, out] (layers/moe.py runs them). gpt-oss's experts add
`mlp.experts.{gate,up,down}_bias` [E, out] and a router bias; weights.py splits its interleaved
gate_up_proj into gate_proj and up_proj.

Attention is delegated: each layer calls
    out, cache = attn_fn(layer_idx, q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D], cache, **options)
with q and k after q/k-norm and RoPE (at `positions`); out is [B, T, Hq, D] and the attn_fn
applies the softmax scale, D**-0.5 unless options holds `scale`. A sliding-window layer passes
`window` (a query at slot p sees slots p - window < s <= p); gpt-oss's layers pass their
`sinks` [Hq] (`self_attn.sinks`, logits in the softmax's denominator only). Options hold only
what the model sets, so a model without them calls attn_fn exactly as five arguments. The cache pytree passes
through the decoder untouched.

Gemma 3 (`cfg.gemma`): embeddings scaled by sqrt(hidden_size) in their dtype, RMSNorm weights as
(1 + w), the attention output and the MLP (GeGLU, tanh GELU) between norms of their own, sliding
layers with their own RoPE base, final logits soft-capped where the config says.
gpt-oss (`cfg.attention_sinks`, `cfg.expert_glu`): attention sinks, biased experts with a clamped
SwiGLU, YaRN RoPE (cos and sin scaled by its attention factor).

To run it as a pure jitted function:
    fns, state = split(model)
    step = jax.jit(fns.forward, static_argnames="attn_fn")
    hidden, cache = step(state, input_ids, positions, attn_fn=attn_fn, cache=cache)
    logits = jax.jit(fns.logits)(state, hidden[:, -1])
Layers are unrolled in a Python loop: on CPU that runs faster than lax.scan over stacked layers.

The engine runs it in stages (`stages`): embed, then groups of layers of one size (one program
serves every group, so compile time does not grow with depth), then the final norm and LM head.
A layer's window and RoPE are static per its index within its group, so the groups must repeat
the model's layer pattern (`repeats_layer_pattern`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from zipage_jax.layers.moe import ExpertBiases, expert_parallel_mlp, grouped_mlp, route
from zipage_jax.layers.norms import RMSNorm
from zipage_jax.layers.rotary import apply_rope, inv_frequencies, rope_cos_sin
from zipage_jax.models.config import ModelConfig

AttnFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

_init = nnx.initializers.normal(stddev=0.02)


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    """A normal(0.02) initialised parameter; with rngs=None only its shape (weights come later)."""
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
    return nnx.Param(_init(rngs.params(), shape, dtype))


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.kernel = _param(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x, self.kernel[...])
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs | None,
                 scale: float | None = None):
        self.weight = _param(rngs, (vocab_size, dim), dtype)  # [V, E]
        self.scale = scale  # the lookup's multiplier, rounded to the weight's dtype (Gemma: sqrt(E))

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = jnp.take(self.weight[...], ids, axis=0)
        return x if self.scale is None else x * jnp.asarray(self.scale, jnp.float32).astype(x.dtype)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """hidden: [..., E] -> logits [..., V] float32."""
        return jnp.einsum("...e,ve->...v", hidden, self.weight[...], preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        E, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.qkv_proj = Linear(E, (cfg.num_heads + 2 * cfg.num_kv_heads) * D, bias=cfg.qkv_bias, dtype=dtype,
                               rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * D, E, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, unit_offset=cfg.gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, unit_offset=cfg.gemma) if cfg.qk_norm else None
        self.sinks = _param(rngs, (cfg.num_heads,), dtype) if cfg.attention_sinks else None

    def __call__(
        self, layer_idx: int, x: jax.Array, cos: jax.Array, sin: jax.Array, attn_fn: AttnFn, cache: Any
    ) -> tuple[jax.Array, Any]:
        B, T, _ = x.shape
        G = self.num_heads // self.num_kv_heads
        qkv = self.qkv_proj(x).reshape(B, T, self.num_kv_heads, G + 2, self.head_dim)  # qkv: [B, T, Hkv, G + 2, D]
        q = qkv[:, :, :, :G].reshape(B, T, self.num_heads, self.head_dim)
        k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]  # [B, T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sinks is None:
            out, cache = attn_fn(layer_idx, q, k, v, cache)  # out: [B, T, Hq, D]
        else:
            out, cache = attn_fn(layer_idx, q, k, v, cache, sinks=self.sinks[...])
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        E, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(E, I, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(E, I, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(I, E, bias=False, dtype=dtype, rngs=rngs)
        self.tanh_gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # else SiLU

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        gate = jax.nn.gelu(gate, approximate=True) if self.tanh_gelu else jax.nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = _param(rngs, (E, H, I), dtype)
        self.up_proj = _param(rngs, (E, H, I), dtype)
        self.down_proj = _param(rngs, (E, I, H), dtype)
        bias = functools.partial(_param, rngs, dtype=dtype) if cfg.expert_bias else lambda shape: None
        self.gate_bias, self.up_bias, self.down_bias = bias((E, I)), bias((E, I)), bias((E, H))
        self.mesh: Mesh | None = None  # expert parallelism: the devices the E axis is split over (engine/sharding.py)


class SparseMoeBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.top_k, self.renormalize, self.glu = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.expert_glu
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.expert_bias, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        flat = x.reshape(-1, x.shape[-1])  # flat: [B * T, hidden]
        weights, experts = route(self.gate(flat), self.top_k, self.renormalize)
        e = self.experts
        args = (flat, weights, experts, e.gate_proj[...], e.up_proj[...], e.down_proj[...])
        options = dict(glu=self.glu, biases=None if e.gate_bias is None else ExpertBiases(
            e.gate_bias[...], e.up_bias[...], e.down_bias[...]))
        out = grouped_mlp(*args, **options) if e.mesh is None else expert_parallel_mlp(e.mesh, *args, **options)
        return out.reshape(x.shape)


class DecoderLayer(nnx.Module):
    """Llama's layer; Gemma's norms the attention output with post_attention_layernorm and puts the
    MLP between pre_ and post_feedforward_layernorm."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, unit_offset=cfg.gemma)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = (SparseMoeBlock if cfg.num_experts else MLP)(cfg, dtype=dtype, rngs=rngs)
        self.pre_feedforward_layernorm = norm() if cfg.gemma else None
        self.post_feedforward_layernorm = norm() if cfg.gemma else None

    def __call__(
        self, layer_idx: int, x: jax.Array, cos: jax.Array, sin: jax.Array, attn_fn: AttnFn, cache: Any
    ) -> tuple[jax.Array, Any]:
        h, cache = self.self_attn(layer_idx, self.input_layernorm(x), cos, sin, attn_fn, cache)
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x)), cache
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), cache


def _layer_inputs(cfg: ModelConfig, positions: jax.Array, num_layers: int, attn_fn: AttnFn
                  ) -> list[tuple[jax.Array, jax.Array, AttnFn]]:
    """(cos, sin, attn_fn with the layer's options bound) for layers 0 .. num_layers - 1."""
    full = rope_cos_sin(positions, inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                        1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_factor)
    sliding = full if cfg.sliding_rope_theta is None else rope_cos_sin(
        positions, inv_frequencies(cfg.head_dim, cfg.sliding_rope_theta))
    scale = {} if cfg.attention_scale is None else {"scale": cfg.attention_scale}
    inputs = []
    for i in range(num_layers):
        options = {**scale, "window": cfg.window(i)} if cfg.window(i) else scale
        inputs.append((*(sliding if cfg.window(i) else full),
                       functools.partial(attn_fn, **options) if options else attn_fn))
    return inputs


def _final_logits(cfg: ModelConfig, lm_head: Embedding, hidden: jax.Array) -> jax.Array:
    logits = lm_head.attend(hidden)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def repeats_layer_pattern(layer_windows: tuple[int, ...], layers_per_group: int) -> bool:
    """Whether every group of `layers_per_group` layers has the first group's windows (and so
    RoPE): what lets one compiled layer program serve every group (ModelConfig.layer_windows)."""
    return all(w == layer_windows[i % layers_per_group] for i, w in enumerate(layer_windows))


class Decoder(nnx.Module):
    """rngs=None builds an abstract decoder (parameter shapes only) to load weights into."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs,
                                      scale=cfg.hidden_size**0.5 if cfg.gemma else None)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, unit_offset=cfg.gemma)
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs
        )

    def __call__(
        self, input_ids: jax.Array, positions: jax.Array, attn_fn: AttnFn, cache: Any
    ) -> tuple[jax.Array, Any]:
        """input_ids, positions: [B, T] int32 -> (hidden [B, T, E] after the final norm, cache)."""
        x = self.embed_tokens(input_ids)  # x: [B, T, E]
        for i, (layer, (cos, sin, attn)) in enumerate(
                zip(self.layers, _layer_inputs(self.cfg, positions, len(self.layers), attn_fn))):
            x, cache = layer(i, x, cos, sin, attn, cache)
        return self.norm(x), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [..., E] (already normed) -> [..., V] float32: the LM head (and soft cap) only."""
        return _final_logits(self.cfg, self.embed_tokens if self.lm_head is None else self.lm_head, hidden)


@dataclass(frozen=True, eq=False)
class DecoderFns:
    """The decoder as pure functions of its parameter state (jit them; attn_fn is static).

    It is a static jit argument, hashed on every call: the graphdef's hash (a walk over the
    whole module tree) is computed once, and equality short-circuits on identity."""

    graphdef: nnx.GraphDef

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self.graphdef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DecoderFns) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)

    def forward(
        self, state: nnx.State, input_ids: jax.Array, positions: jax.Array, attn_fn: AttnFn, cache: Any
    ) -> tuple[jax.Array, Any]:
        return nnx.merge(self.graphdef, state)(input_ids, positions, attn_fn, cache)

    def logits(self, state: nnx.State, hidden: jax.Array) -> jax.Array:
        return nnx.merge(self.graphdef, state).logits(hidden)


def split(model: Decoder) -> tuple[DecoderFns, nnx.State]:
    graphdef, state = nnx.split(model)
    return DecoderFns(graphdef), state


@dataclass(frozen=True)
class StageParams:
    """The decoder's parameters per stage, each a flat list of arrays (a jitted call flattens
    its arguments every time: an nnx.State costs more host time than a list)."""

    embed: list[jax.Array]  # the token embedding
    groups: list[list[list[jax.Array]]]  # per group of layers, per layer
    head: list[jax.Array]  # final norm, then the LM head (the embedding when tied)


@dataclass(frozen=True, eq=False)
class DecoderStages:
    """The decoder as pure functions of stage parameters (see StageParams); static jit argument."""

    cfg: ModelConfig
    embed_def: nnx.GraphDef
    layer_def: nnx.GraphDef
    head_def: nnx.GraphDef  # a _Head
    embed_tree: Any
    layer_tree: Any
    head_tree: Any

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.cfg, self.embed_def, self.layer_def, self.head_def)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DecoderStages) and self._hash == other._hash
                                 and self.cfg == other.cfg and (self.embed_def, self.layer_def, self.head_def)
                                 == (other.embed_def, other.layer_def, other.head_def))

    def embed(self, embed: list[jax.Array], input_ids: jax.Array) -> jax.Array:
        """input_ids: [B, T] -> x [B, T, E]."""
        return nnx.merge(self.embed_def, jax.tree.unflatten(self.embed_tree, embed))(input_ids)

    def layers(self, group: list[list[jax.Array]], x: jax.Array, positions: jax.Array, attn_fn: AttnFn,
               cache: Any) -> tuple[jax.Array, Any]:
        """One group of layers; attn_fn sees them as layers 0 .. len(group) - 1 of `cache`."""
        for i, (leaves, (cos, sin, attn)) in enumerate(
                zip(group, _layer_inputs(self.cfg, positions, len(group), attn_fn))):
            layer = nnx.merge(self.layer_def, jax.tree.unflatten(self.layer_tree, leaves))
            x, cache = layer(i, x, cos, sin, attn, cache)
        return x, cache

    def _head(self, head: list[jax.Array]) -> "_Head":
        return nnx.merge(self.head_def, jax.tree.unflatten(self.head_tree, head))

    def norm(self, head: list[jax.Array], x: jax.Array) -> jax.Array:
        """x: [..., E] after the last layer -> the final norm's output."""
        return self._head(head).norm(x)

    def logits(self, head: list[jax.Array], hidden: jax.Array) -> jax.Array:
        """hidden: [..., E] (normed) -> [..., V] float32."""
        return _final_logits(self.cfg, self._head(head).lm_head, hidden)


class _Head(nnx.Module):
    def __init__(self, norm: RMSNorm, lm_head: Embedding):
        self.norm, self.lm_head = norm, lm_head


def stages(model: Decoder, layers_per_group: int) -> tuple[DecoderStages, StageParams]:
    """The decoder cut into stages, its layers in groups of `layers_per_group` (a divisor of the depth
    whose groups repeat the layer pattern)."""
    L = len(model.layers)
    if L % layers_per_group:
        raise ValueError(f"{layers_per_group} layers per group do not divide {L} layers")
    if not repeats_layer_pattern(model.cfg.layer_windows, layers_per_group):
        raise ValueError(f"groups of {layers_per_group} layers do not repeat the model's layer pattern "
                         f"(sliding windows per layer: {model.cfg.layer_windows})")
    embed_def, embed_state = nnx.split(model.embed_tokens)
    head_def, head_state = nnx.split(_Head(model.norm, model.embed_tokens if model.lm_head is None else model.lm_head))
    layer_splits = [nnx.split(layer) for layer in model.layers]
    embed, embed_tree = jax.tree.flatten(embed_state)
    head, head_tree = jax.tree.flatten(head_state)
    flat = [jax.tree.flatten(state) for _, state in layer_splits]
    layers = [leaves for leaves, _ in flat]
    fns = DecoderStages(model.cfg, embed_def, layer_splits[0][0], head_def, embed_tree, flat[0][1], head_tree)
    groups = [layers[i:i + layers_per_group] for i in range(0, L, layers_per_group)]
    return fns, StageParams(embed, groups, head)
