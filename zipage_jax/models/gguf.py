"""GGUF files (llama.cpp): tensors dequantized by gguf-py, the config, and names as transformers'."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

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


# GGUF tensor name -> transformers name, for the llama / qwen2 / qwen3 families.
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
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


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


def hf_config(reader: GGUFReader) -> dict:
    """The file's model metadata as a transformers-style config dict."""
    arch = field_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported architecture {arch!r} in GGUF file; supported: llama, qwen2, qwen3")
    if field_value(reader, f"{arch}.rope.scaling.type", "none") != "none" or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ValueError("unsupported GGUF RoPE scaling (rope.scaling.type / rope_freqs.weight)")
    heads = field_value(reader, f"{arch}.attention.head_count")
    hidden = field_value(reader, f"{arch}.embedding_length")
    return {
        "model_type": arch,
        "vocab_size": field_value(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": field_value(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field_value(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field_value(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": field_value(reader, f"{arch}.attention.key_length")
        or field_value(reader, f"{arch}.rope.dimension_count")
        or hidden // heads,
        "rms_norm_eps": field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field_value(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field_value(reader, f"{arch}.context_length"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
    }


def read_tensors(reader: GGUFReader, config: dict) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32, under transformers names."""
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if config["model_type"] == "llama" and ".q_proj." in name:
            w = _unpermute(w, config["num_attention_heads"])
        elif config["model_type"] == "llama" and ".k_proj." in name:
            w = _unpermute(w, config["num_key_value_heads"])
        tensors[name] = w
    return tensors
