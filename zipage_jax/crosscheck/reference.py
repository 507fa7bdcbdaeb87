"""transformers' PyTorch model on the same weights as ours: the reference of every crosscheck."""

from __future__ import annotations

from pathlib import Path


def load_reference_model(source: str):
    """A float32 transformers causal LM from a model directory or a .gguf file (its own GGUF loader)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(source)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()
