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


def reference_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate` of exactly `new_tokens` tokens, EOS not special (as with
    ignore_eos: EOS may be generated and generation goes on; min_new_tokens would mask it)."""
    import torch

    ids = torch.tensor([prompt_ids])
    # eos_token_id=None as an explicit argument: set on a GenerationConfig instead, transformers 5
    # falls back to the model's EOS and stops there
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
