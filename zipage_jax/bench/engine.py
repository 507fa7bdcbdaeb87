"""This engine vs HF transformers `generate` (and llama.cpp when installed) on the same model.

    zipage-jax bench engine [--model default] [--batches 1 16 64] [--new-tokens 64] [--runs 3] [--json] [--out PATH]
    zipage-jax bench engine --skip-hf --baseline COMMIT [--rounds 3] ...

Greedy decoding of a fixed number of new tokens (EOS ignored) for a batch of prompts; output
tokens per second, median of --runs timed runs after one warm-up (which also compiles), the
engine's and HF's runs interleaved. Per batch it also breaks the engine's decode step down:
its median decode step against the model's matrix products alone at that batch (every layer's
projections and the LM head, one jitted chain on the same weights): the floor no engine on
this machine goes under. The last line with --json is one JSON object with every figure and
the ratios against HF.

With --baseline COMMIT the benchmark runs --rounds times in this tree and in a checkout of
COMMIT (bench/trees.py), in turns, each run a process of its own with the same flags; the result
holds each tree's runs, their medians per batch and the ratios of this tree's decode step and
tokens/s to the baseline's (goal: the decode step at most DECODE_GOAL x the baseline's, its noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from zipage_jax.harness import add_output_arguments, build_llm, emit, log, median_seconds

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


def zipage_run(llm, batch: int, new_tokens: int) -> tuple[float, list[float]]:
    """Seconds for one batch; and the seconds of each step that only decoded."""
    from zipage_jax import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    ids = [engine.add_request(PROMPT, params, stream=False) for _ in range(batch)]
    decode_steps = []
    start = time.perf_counter()
    finished = {}
    while engine.has_unfinished_requests():
        prefill = engine.stats.prefill_tokens
        step_start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if engine.stats.prefill_tokens == prefill:
            decode_steps.append(time.perf_counter() - step_start)
    seconds = time.perf_counter() - start
    assert all(len(finished[i].outputs[0].token_ids) == new_tokens for i in ids)
    return seconds, decode_steps


def hf_run(model, tokenizer, batch: int, new_tokens: int) -> float:
    import torch

    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]] * batch)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        return time.perf_counter() - start


def matmul_floor_seconds(model, batch: int, runs: int = 10) -> float:
    """One decode step's matrix products alone at `batch` rows: q/k/v, o, gate, up and down of
    every layer and the LM head, in one jitted chain over the decoder's weights (the engine's)."""
    import jax
    import jax.numpy as jnp

    layers = [(layer.self_attn.qkv_proj.kernel[...], layer.self_attn.o_proj.kernel[...],
               layer.mlp.gate_proj.kernel[...], layer.mlp.up_proj.kernel[...], layer.mlp.down_proj.kernel[...])
              for layer in model.layers]
    head = (model.embed_tokens if model.lm_head is None else model.lm_head).weight[...]

    @jax.jit
    def chain(x, layers, head):
        for qkv, o, gate, up, down in layers:
            x = x + (x @ qkv)[:, : o.shape[0]] @ o
            x = x + (jax.nn.silu(x @ gate) * (x @ up)) @ down
        return jnp.einsum("be,ve->bv", x, head)

    x = jnp.full((batch, head.shape[1]), 0.01, model.dtype)
    chain(x, layers, head).block_until_ready()
    return median_seconds(lambda: chain(x, layers, head).block_until_ready(), runs)


def bench_batch(llm, model, hf, batch: int, new_tokens: int, runs: int) -> dict:
    """Tokens/s of the engine and HF, runs interleaved; the decode-step breakdown."""
    zipage_run(llm, batch, new_tokens)  # warm-up: compiles every bucket this batch uses
    if hf is not None:
        hf_run(hf, llm.tokenizer, batch, 2)
    ours, theirs, steps = [], [], []
    for _ in range(runs):
        seconds, decode_steps = zipage_run(llm, batch, new_tokens)
        ours.append(seconds)
        steps += decode_steps
        if hf is not None:
            theirs.append(hf_run(hf, llm.tokenizer, batch, new_tokens))
    row = {"zipage_tok_s": batch * new_tokens / statistics.median(ours)}
    if hf is not None:
        row["hf_tok_s"] = batch * new_tokens / statistics.median(theirs)
        row["ratio_vs_hf"] = row["zipage_tok_s"] / row["hf_tok_s"]
    floor = matmul_floor_seconds(model, batch)
    row["decode_step_ms"] = 1e3 * statistics.median(steps)
    row["matmul_floor_ms"] = 1e3 * floor
    row["decode_step_over_floor"] = statistics.median(steps) / floor
    return row


def bench_llama_cpp(gguf_path: str, new_tokens: int, runs: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=gguf_path, n_ctx=512, n_threads=os.cpu_count(), verbose=False)
    llm(PROMPT, max_tokens=4, temperature=0)

    def generate() -> None:
        out = llm(PROMPT, max_tokens=new_tokens, temperature=0, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == new_tokens

    return new_tokens / median_seconds(generate, runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--baseline", metavar="COMMIT", help="also run the benchmark at this commit, in turns")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each tree")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.baseline:
        from zipage_jax.bench.engine_baseline import run_against_baseline

        return emit(run_against_baseline(args), args)
    from zipage_jax.crosscheck.reference import load_reference_model
    from zipage_jax.models.loading import load_model

    loaded = load_model(args.model)
    llm = build_llm(args.model, loaded=loaded, max_num_seqs=max(args.batches), kvcache_block_size=32, warmup=True)
    source = str(loaded.source)
    results: dict = {"model": source, "new_tokens": args.new_tokens, "runs": args.runs, "batches": {}}
    hf = None if args.skip_hf else load_reference_model(source)
    for batch in args.batches:
        row = bench_batch(llm, loaded.model, hf, batch, args.new_tokens, args.runs)
        results["batches"][str(batch)] = row
        log(f"batch {batch:3d}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    if source.endswith(".gguf"):
        cpp = bench_llama_cpp(source, args.new_tokens, args.runs)
        if cpp is not None:
            results["llama_cpp_tok_s_batch1"] = cpp
            if "1" in results["batches"]:
                results["batches"]["1"]["ratio_vs_llama_cpp"] = results["batches"]["1"]["zipage_tok_s"] / cpp
    return emit(results, args)
