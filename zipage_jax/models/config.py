"""ModelConfig: the decoder's shape and numerics, read from a transformers config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from zipage_jax.layers.moe import ClampedSwiGLU
from zipage_jax.layers.rotary import RopeScaling

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "gpt_oss"]

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}
_MODEL_TYPES = {family: name for name, family in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelConfig:
    """Frozen and hashable: a static argument of the jitted model functions."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q_proj, k_proj, v_proj
    o_bias: bool  # bias on o_proj
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # mixture of experts (0 experts: a dense MLP of intermediate_size in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top-k router weights renormalised to sum to 1
    expert_bias: bool = False  # biases on the router and on each expert's products (gpt-oss)
    expert_glu: ClampedSwiGLU | None = None  # the experts' clamped SwiGLU (gpt-oss; None: SwiGLU)
    # sliding-window attention: per layer the window in tokens, 0 for a full-attention layer;
    # empty: every layer attends to its whole context
    layer_windows: tuple[int, ...] = ()
    hidden_act: Literal["silu", "gelu_pytorch_tanh"] = "silu"  # the MLP's gate activation
    sliding_rope_theta: float | None = None  # RoPE base of the sliding-window layers (None: rope_theta)
    attention_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attention_sinks: bool = False  # a learned sink logit per query head in every layer (gpt-oss)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows must hold one window >= 0 per layer ({self.num_layers}), "
                             f"got {self.layer_windows}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens; 0 where it attends to its whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def gemma(self) -> bool:
        """Gemma's numerics: embeddings scaled by sqrt(hidden_size), RMSNorm weights as (1 + w),
        the attention and MLP outputs normed too (four norms per layer)."""
        return self.architecture == "gemma3_text"

    @property
    def mlp_width(self) -> int:
        """The intermediate width of each layer's MLP (one expert's, for a mixture of experts)."""
        return self.moe_intermediate_size if self.num_experts else self.intermediate_size

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """From a transformers PretrainedConfig or its config.json dict (v4 or v5 RoPE fields)."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        architecture = _architecture(c)
        quant = (c.get("quantization_config") or {}).get("quant_method")
        if quant == "mxfp4":
            raise ValueError("unsupported quantization_config quant_method 'mxfp4' (the released gpt-oss "
                             "weights); use a checkpoint dequantized to bfloat16")
        if architecture != "gemma3_text" and c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c['hidden_act']!r}; only 'silu' is supported")
        if c.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True")
        if c.get("use_sliding_window"):
            raise ValueError("unsupported use_sliding_window=True (sliding-window attention)")
        num_heads = c["num_attention_heads"]
        gemma = _gemma3(c) if architecture == "gemma3_text" else {}
        gpt_oss = _gpt_oss(c) if architecture == "gpt_oss" else {}
        rope_theta, rope_scaling = _rope(gemma.pop("full_rope", c))
        attention_bias = bool(c.get("attention_bias", False))
        eos = c.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=float(c["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=c["max_position_embeddings"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2" or attention_bias,
            o_bias=architecture != "qwen2" and attention_bias,
            qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,)),
            **_experts(c, architecture),
            **gemma,
            **gpt_oss,
        )


def _architecture(c: dict) -> Architecture:
    supported = ", ".join(ARCHITECTURES)
    names = c.get("architectures") or []
    if names:
        if names[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {names[0]!r}; supported: {supported}")
        return ARCHITECTURES[names[0]]
    model_type = c.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"unsupported architecture (model_type {model_type!r}); supported: {supported}")
    return model_type


def _experts(c: dict, architecture: Architecture) -> dict[str, Any]:
    """The mixture-of-experts fields of Qwen3-MoE and Mixtral (none for dense families).

    Qwen3-MoE routes every layer when decoder_sparse_step is 1 and mlp_only_layers is empty;
    dense layers among sparse ones are refused (one compiled layer program serves every layer).
    Mixtral always renormalises its top-k weights; its sliding window is refused where it would
    mask anything (transformers applies it whenever sliding_window is set)."""
    if architecture not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return {}
    for name in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if c.get(name):
            raise ValueError(f"unsupported {name}={c[name]!r} (shared experts)")
    num_experts = c.get("num_experts") or c.get("num_local_experts") or 0  # transformers writes either
    if architecture == "mixtral":
        window = c.get("sliding_window")
        if window is not None and window < c["max_position_embeddings"]:
            raise ValueError(f"unsupported sliding_window={window} (below max_position_embeddings="
                             f"{c['max_position_embeddings']}: sliding-window attention)")
        return dict(num_experts=num_experts, num_experts_per_tok=c["num_experts_per_tok"],
                    moe_intermediate_size=c["intermediate_size"], norm_topk_prob=True)
    if architecture == "gpt_oss":  # softmax over the top-k router logits: the renormalised top-k softmax
        return dict(num_experts=num_experts, num_experts_per_tok=c["num_experts_per_tok"],
                    moe_intermediate_size=c["intermediate_size"], norm_topk_prob=True, expert_bias=True,
                    expert_glu=ClampedSwiGLU(float(c.get("swiglu_limit", 7.0)), float(c.get("swiglu_alpha", 1.702))))
    if not num_experts:  # transformers builds every layer dense then
        return {}
    if c.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"unsupported decoder_sparse_step={c['decoder_sparse_step']} (dense layers among "
                         "sparse ones); only 1 is supported")
    if c.get("mlp_only_layers"):
        raise ValueError(f"unsupported mlp_only_layers={c['mlp_only_layers']} (dense layers among sparse ones); "
                         "only an empty list is supported")
    return dict(num_experts=num_experts, num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c["moe_intermediate_size"], norm_topk_prob=bool(c.get("norm_topk_prob")))


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_windows(c: dict, default_types: list[str]) -> tuple[int, ...]:
    """Per layer the sliding window (`sliding_window` tokens) or 0 (full attention), from
    `layer_types` or, where the config has none, `default_types`."""
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or default_types
    if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
        raise ValueError(f"layer_types must name {layers} layers, each one of {_LAYER_TYPES}, got {types}")
    window = c.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _gpt_oss(c: dict) -> dict[str, Any]:
    """gpt-oss's attention: learned sinks in every layer, sliding layers (by default every other
    one, from the first) sharing the full layers' RoPE."""
    return dict(attention_sinks=True,
                layer_windows=_layer_windows(c, ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                 for i in range(c["num_hidden_layers"])]))


def _gemma3(c: dict) -> dict[str, Any]:
    """Gemma 3's fields (v4 or v5 config), plus "full_rope": the config _rope reads the full-attention
    layers' RoPE from. Sliding layers attend to the `sliding_window` most recent tokens (their own
    included) with RoPE base `rope_local_base_freq`, unscaled; the layer types come from
    `layer_types` or, in older configs, every `sliding_window_pattern`-th layer (default 6) is full."""
    if c.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=True")
    if c.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 attention never applies it: refused rather than guessed
        raise ValueError(f"unsupported attn_logit_softcapping={c['attn_logit_softcapping']!r}")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r}; only 'gelu_pytorch_tanh' is supported")
    pattern = c.get("sliding_window_pattern") or 6
    windows = _layer_windows(c, ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(c["num_hidden_layers"])])
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:  # v5: one RoPE per layer type
        full = {"rope_parameters": params["full_attention"]}
        sliding = {"rope_parameters": params.get("sliding_attention") or {"rope_theta": 10_000.0}}
    else:
        full = {**c, "rope_theta": c.get("rope_theta") or 1_000_000.0}
        sliding = {"rope_theta": c.get("rope_local_base_freq") or 10_000.0}
    sliding_theta, sliding_scaling = _rope(sliding)
    if sliding_scaling is not None:
        raise ValueError(f"unsupported RoPE scaling of the sliding-window layers: {sliding_scaling}")
    return dict(full_rope=full, layer_windows=windows, hidden_act=act, sliding_rope_theta=sliding_theta,
                attention_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
                final_logit_softcapping=c.get("final_logit_softcapping"))


def _rope(c: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`."""
    params = dict(c.get("rope_scaling") or {})
    params.update(c.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported partial_rotary_factor != 1.0")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", c["max_position_embeddings"])
            ),
        )
    if rope_type == "yarn":
        return theta, _yarn(params, c)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3, yarn")


def _yarn(params: dict, c: dict) -> RopeScaling:
    """YaRN's fields, defaults and attention factor as transformers' _compute_yarn_parameters reads them."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or c["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", float(factor), original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))
