"""A mixture-of-experts decode step against the same model with one dense MLP of the active width.

    zipage-jax bench moe [--batch 64] [--experts 8] [--top-k 2] [--hidden 256] [--expert-width 128]
        [--layers 2] [--runs 30] [--dtype float32] [--json] [--out PATH]

Two random Qwen3-shaped models differ in their MLP only: the MoE routes each token to --top-k
of --experts experts of width --expert-width (sorted by expert, grouped matrix products); the
dense one has one MLP of width top-k * expert-width, the FLOPs each token spends in the MoE. Each
times the bare decode step (bare_step.py: forward and greedy sampling, no engine) at --batch rows,
the steps interleaved, medians of --runs. The result: both medians, their ratio (MoE / dense)
and whether it is within the goal (GOAL).
"""

from __future__ import annotations

import argparse

from zipage_jax.harness import add_output_arguments, emit, interleaved_medians, log

GOAL = 1.5  # the MoE step at most this many times the dense step of the same active width


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--batch", type=int, default=64, help="decode rows per step")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--hidden", type=int, default=256, help="the model's hidden size")
    parser.add_argument("--expert-width", type=int, default=128, help="each expert's MLP width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="the position every row decodes at")
    parser.add_argument("--runs", type=int, default=30, help="timed steps per model, interleaved")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on an accelerator")
    add_output_arguments(parser)


def shapes(args: argparse.Namespace) -> dict[str, dict]:
    """ModelConfig fields of the two models: "moe" and "dense" (the MoE's active width)."""
    from zipage_jax.models.random_model import QWEN3_8B

    heads = max(1, args.hidden // 64)
    common = {**QWEN3_8B, "vocab_size": 256, "hidden_size": args.hidden, "num_layers": args.layers,
              "num_heads": heads, "num_kv_heads": max(1, heads // 2), "head_dim": 64,
              "intermediate_size": args.top_k * args.expert_width}
    moe = {**common, "architecture": "qwen3_moe", "num_experts": args.experts, "num_experts_per_tok": args.top_k,
           "moe_intermediate_size": args.expert_width, "norm_topk_prob": True}
    return {"moe": moe, "dense": common}


def run(args: argparse.Namespace) -> int:
    import jax

    from zipage_jax.bench.bare_step import BareStep
    from zipage_jax.models.loading import resolve_dtype
    from zipage_jax.models.random_model import random_model

    dtype = resolve_dtype(args.dtype)
    steps = {}
    for name, shape in shapes(args).items():
        steps[name] = BareStep(random_model(shape, dtype), args.batch, args.context, steps=1, block_size=16)
        steps[name].run()  # compiles
    log(f"timing {args.runs} interleaved decode steps of each model at batch {args.batch}")
    seconds = interleaved_medians({name: step.run for name, step in steps.items()}, args.runs)
    ratio = seconds["moe"] / seconds["dense"]
    return emit({"batch": args.batch, "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                 "expert_width": args.expert_width, "layers": args.layers, "context": args.context,
                 "dtype": dtype, "device": str(jax.devices()[0].device_kind), "runs": args.runs,
                 "ms": {name: 1e3 * s for name, s in seconds.items()}, "ratio": ratio, "goal": GOAL,
                 "within_goal": ratio <= GOAL}, args)
