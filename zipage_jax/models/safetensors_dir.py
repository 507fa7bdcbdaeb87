"""A transformers model directory: config.json, tokenizer files, (sharded) model.safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_file_names(model_dir: Path) -> list[str]:
    """The names of the safetensors files holding the weights: the shards the index names, else model.safetensors."""
    index = model_dir / INDEX_FILE
    if not index.exists():
        return [SINGLE_FILE]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"corrupt safetensors index {index}: {exc}") from exc
    return sorted(set(weight_map.values()))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights (the shards named by the index, if sharded)."""
    files = [model_dir / name for name in weight_file_names(model_dir)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing safetensors file {f}")
    return files


def read_tensors(model_dir: Path) -> dict[str, jax.Array]:
    """All tensors of the checkpoint, by transformers name, in their stored dtype."""
    tensors = {}
    for f in weight_files(model_dir):
        try:
            with safe_open(f, framework="flax") as st:
                for name in st.keys():
                    tensors[name] = st.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"corrupt or truncated safetensors file {f}: {exc}") from exc
    return tensors
