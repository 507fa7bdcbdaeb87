"""GGUF files (llama.cpp): our dequantizers, the config, and tensors renamed to transformers'.

Each dequantizer takes the tensor's raw blocks `[N, type_size]` uint8 and returns `[N, block_size]`
float32, computing in the same order as gguf.quants so results are bit-identical.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

Q = GGMLQuantizationType


def _f16(blocks: np.ndarray) -> np.ndarray:
    """blocks: [N, 2] uint8 -> [N, 1] float32."""
    return blocks.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs: [..., K] uint8 -> [..., 2, K]: low nibbles, then high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _dequant_q8_0(b: np.ndarray) -> np.ndarray:
    # b: [N, 34] = d f16 | qs int8[32]
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:
    # b: [N, 18] = d f16 | qs u8[16] (element i in the low nibble of byte i, i + 16 in its high one)
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).astype(np.int8) - np.int8(8)
    return _f16(b[:, :2]) * q.astype(np.float32)


def _dequant_q4_1(b: np.ndarray) -> np.ndarray:
    # b: [N, 20] = d f16 | m f16 | qs u8[16]
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """s: [N, 12] uint8: 8 six-bit scales and 8 six-bit mins -> ([N, 8], [N, 8]) uint8."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    # b: [N, 144] = d f16 | dmin f16 | scales u8[12] | qs u8[128]; 8 sub-blocks of 32
    n = len(b)
    scales, mins = _q4_k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * scales.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mins.astype(np.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (d * q - dm).reshape(n, 256)


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    # b: [N, 210] = ql u8[128] | qh u8[64] | scales int8[16] | d f16; two halves of 128, 16 scales of 16
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    low = _nibbles(ql).reshape(n, 2, 128)
    high = (qh & 0x03).reshape(n, 2, 128)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


_BLOCK_DEQUANTIZERS = {
    Q.Q8_0: _dequant_q8_0,
    Q.Q4_0: _dequant_q4_0,
    Q.Q4_1: _dequant_q4_1,
    Q.Q4_K: _dequant_q4_k,
    Q.Q6_K: _dequant_q6_k,
}
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, *_BLOCK_DEQUANTIZERS)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """data: a GGUFReader tensor's data (its rows' raw bytes for block types) -> float32 [rows, cols]."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    if qtype == Q.F32:
        return raw.view(np.float32)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype not in _BLOCK_DEQUANTIZERS:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}; supported: {names}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[:-1]
    blocks = _BLOCK_DEQUANTIZERS[qtype](raw.reshape(-1, type_size))
    return blocks.reshape(*rows, raw.shape[-1] // type_size * block_size)


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
