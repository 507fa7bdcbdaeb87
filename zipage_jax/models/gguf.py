"""GGUF files (llama.cpp): tensors dequantized by gguf-py, the config, and names as transformers'."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from zipage_jax.models.config import ARCHITECTURES

Q = GGMLQuantizationType


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """data: a GGUFReader tensor's data (its rows' raw bytes for block types) -> float32 [rows, cols].

    gguf-py's own dequantization, for every type it reads; ValueError naming the type otherwise.
    """
    try:
        out = gguf.quants.dequantize(np.ascontiguousarray(data), qtype)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}: gguf-py cannot dequantize it; "
                         f"readable types: {', '.join(t.name for t in readable_types())}") from None
    return np.asarray(out, dtype=np.float32)


@functools.cache
def readable_types() -> tuple[GGMLQuantizationType, ...]:
    """The tensor types gguf-py dequantizes (each tried on one zero block)."""
    readable = []
    for qtype in Q:
        block_size, type_size = GGML_QUANT_SIZES.get(qtype, (1, 0))
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:
            continue
        except Exception:  # noqa: BLE001 - a type whose zero block is invalid is still one gguf-py implements
            pass
        readable.append(qtype)
    return tuple(readable)


# GGUF `general.architecture` -> the transformers architecture it loads as (config.ARCHITECTURES):
# the one table of the architectures a GGUF file may have. llama.cpp writes Mixtral as "llama"
# with experts (`llama.expert_count` > 0): see gguf_architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"

# GGUF tensor name -> transformers name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# Gemma normalises the attention and MLP outputs too: four norms per layer
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Expert MLPs: stacked, [E, out, in] once the ggml dims are reversed (blk.N.ffn_gate_exps.weight), or one
# tensor per expert (older Mixtral files: blk.N.ffn_gate.J.weight)
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_exps|\.(\d+))\.weight")


def hf_name(name: str, arch: str = "llama") -> str:
    """A GGUF tensor name of a file of architecture `arch` -> its transformers name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _expert_tensors(m: re.Match, w: np.ndarray) -> dict[str, np.ndarray]:
    """An expert tensor (its name's _EXPERTS_RE match) -> each expert's matrix [out, in] under its
    transformers name (Qwen3-MoE's naming, which Mixtral's loads under too)."""
    layer, proj, expert = m.groups()
    prefix = f"model.layers.{layer}.mlp.experts"
    if expert is not None:
        return {f"{prefix}.{expert}.{proj}_proj.weight": w}
    if w.ndim != 3:
        raise ValueError(f"GGUF tensor {m.string!r} has shape {w.shape}; expected [experts, out, in]")
    return {f"{prefix}.{j}.{proj}_proj.weight": w[j] for j in range(len(w))}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (as transformers' GGUF loader does). w: [n_head * D, ...]."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways on a short or damaged file
        raise ValueError(f"corrupt or truncated GGUF file {path}: {exc}") from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"corrupt or truncated GGUF file {path}: tensor data ends at byte {end}")
    return reader


def field_value(reader: GGUFReader, key: str, default=None):
    """A metadata value (`tokenizer.ggml.tokens` -> list of str), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def required_value(reader: GGUFReader, key: str):
    """A metadata value the file must have (ValueError naming the key otherwise)."""
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF file has no {key}")
    return value


def gguf_architecture(reader: GGUFReader) -> str:
    """The transformers architecture the file loads as (ValueError for one it cannot)."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in GGUF file; supported: {', '.join(GGUF_ARCHITECTURES)}")
    if arch == "llama" and field_value(reader, "llama.expert_count", 0):
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def hf_config(reader: GGUFReader) -> dict:
    """The file's model metadata as a transformers-style config dict."""
    architecture = gguf_architecture(reader)
    arch = field_value(reader, "general.architecture")
    if field_value(reader, f"{arch}.rope.scaling.type", "none") != "none" or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ValueError("unsupported GGUF RoPE scaling (rope.scaling.type / rope_freqs.weight)")
    heads = field_value(reader, f"{arch}.attention.head_count")
    hidden = field_value(reader, f"{arch}.embedding_length")
    head_dim = (field_value(reader, f"{arch}.attention.key_length")
                or field_value(reader, f"{arch}.rope.dimension_count")
                or hidden // heads)
    config = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": field_value(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": field_value(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field_value(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field_value(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field_value(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field_value(reader, f"{arch}.context_length"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        config.update(_gemma3_fields(reader, head_dim))
    elif architecture == MIXTRAL:
        config.update(num_local_experts=field_value(reader, "llama.expert_count"),
                      num_experts_per_tok=required_value(reader, "llama.expert_used_count"))
    elif arch == "qwen3moe":
        config.update(_qwen3moe_fields(reader))
    return config


def _qwen3moe_fields(reader: GGUFReader) -> dict:
    """Qwen3-MoE's experts. llama.cpp always renormalises their top-k weights for this architecture
    (it stores no key for it; transformers' GGUF loader sets norm_topk_prob the same way)."""
    return {
        "num_experts": required_value(reader, "qwen3moe.expert_count"),
        "num_experts_per_tok": required_value(reader, "qwen3moe.expert_used_count"),
        "moe_intermediate_size": required_value(reader, "qwen3moe.expert_feed_forward_length"),
        "norm_topk_prob": True,
    }


def _gemma3_fields(reader: GGUFReader, head_dim: int) -> dict:
    """What llama.cpp fixes for every Gemma 3 file rather than storing it: every 6th layer attends
    to its whole context, the others to `attention.sliding_window` tokens with RoPE base 10,000,
    and queries are scaled by head_dim ** -0.5 (transformers' GGUF loader keeps its config's
    defaults, the same for every size but 27B)."""
    return {
        "sliding_window": required_value(reader, "gemma3.attention.sliding_window"),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def read_tensors(reader: GGUFReader, config: dict) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32, under transformers names (stacked experts split into
    one matrix per expert, as transformers' checkpoints store them).

    llama.cpp stores Llama's (and Mixtral's) Q and K rows permuted, and Gemma's RMSNorm weights with
    the 1 of Gemma's (1 + w) already added: both undone here, as transformers' GGUF loader does."""
    arch = field_value(reader, "general.architecture")
    tensors = {}
    for t in reader.tensors:
        experts = _EXPERTS_RE.fullmatch(t.name)
        name = None if experts else hf_name(t.name, arch)  # an unexpected name fails before any reading
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if experts:
            tensors.update(_expert_tensors(experts, w))
            continue
        if arch == "llama" and ".q_proj." in name:
            w = _unpermute(w, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            w = _unpermute(w, config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w - np.float32(1)
        tensors[name] = w
    return tensors
