"""python -m zipage_jax.crosscheck logits --model M [--prompt TEXT] [--json]

Runs the same token ids through this decoder and transformers' PyTorch model on the same
weights (for GGUF, transformers' own GGUF loader), both in float32, and compares the logits at
every position. Passes when max |diff| <= 1e-3 * max(1, max |logit|) and top-1 agrees everywhere.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from zipage_jax.crosscheck.reference import load_reference_model
from zipage_jax.layers.attention import causal_attention
from zipage_jax.models.decoder import Decoder, split
from zipage_jax.models.loading import load_model

DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is"
RELATIVE_TOLERANCE = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default', a model directory or a .gguf file")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--cache-dir", default=None, help="converted-parameter cache (default: ZIPAGE_JAX_CACHE)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")


def run(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, dtype="float32", cache_dir=args.cache_dir)
    ids = list(loaded.tokenizer(args.prompt)["input_ids"])
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    ours = model_logits(loaded.model, ids)
    ref = transformers_logits(loaded.source, ids)
    result = compare(ours, ref)
    print(f"model {loaded.source} ({len(ids)} tokens, float32)")
    print(f"{'pos':>4} {'token':>7} {'max|d|':>10} {'mean|d|':>10} {'top1':>7} {'ref':>7}")
    for p in result["positions"]:
        mark = "" if p["ours_top1"] == p["ref_top1"] else "  MISMATCH"
        print(
            f"{p['pos']:>4} {ids[p['pos']]:>7} {p['max_abs_diff']:>10.3e} {p['mean_abs_diff']:>10.3e}"
            f" {p['ours_top1']:>7} {p['ref_top1']:>7}{mark}"
        )
    print(
        f"max |diff| {result['max_abs_diff']:.3e} (tolerance {result['tolerance']:.3e}), "
        f"top-1 agreement {result['top1_agreement']:.1%}: {'OK' if result['ok'] else 'FAIL'}"
    )
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def model_logits(model: Decoder, ids: list[int]) -> np.ndarray:
    """Our float32 logits [T, V] for one sequence, with plain causal attention."""
    fns, state = split(model)
    input_ids = np.asarray([ids], dtype=np.int32)
    positions = np.arange(len(ids), dtype=np.int32)[None]

    @jax.jit
    def logits(state, input_ids, positions):
        hidden, _ = fns.forward(state, input_ids, positions, causal_attention, None)
        return fns.logits(state, hidden)

    return np.asarray(logits(state, input_ids, positions))[0]


def transformers_logits(source: str, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits [T, V] for the same weights (a model directory or a .gguf file)."""
    import torch

    model = load_reference_model(source)
    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    """Per-position and overall |diff| and top-1 agreement of two [T, V] logit arrays."""
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    ours_top1, ref_top1 = ours.argmax(-1), ref.argmax(-1)
    tolerance = RELATIVE_TOLERANCE * max(1.0, float(np.abs(ref).max()))
    agreement = float((ours_top1 == ref_top1).mean())
    max_abs_diff = float(diff.max())
    return {
        "ok": max_abs_diff <= tolerance and agreement == 1.0,
        "max_abs_diff": max_abs_diff,
        "mean_abs_diff": float(diff.mean()),
        "top1_agreement": agreement,
        "tolerance": tolerance,
        "positions": [
            {
                "pos": t,
                "max_abs_diff": float(diff[t].max()),
                "mean_abs_diff": float(diff[t].mean()),
                "ours_top1": int(ours_top1[t]),
                "ref_top1": int(ref_top1[t]),
            }
            for t in range(len(diff))
        ],
    }
