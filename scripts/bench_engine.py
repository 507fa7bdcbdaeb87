"""This engine vs HF transformers `generate` (and llama.cpp when installed) on the same model.

    python scripts/bench_engine.py [--model default] [--batches 1 16 64] [--new-tokens 64] [--runs 3] [--json]

Greedy decoding of a fixed number of new tokens (EOS ignored) for a batch of prompts; output
tokens per second, median of --runs timed runs after one warm-up (which also compiles). The
last line with --json is one JSON object with every figure and the ratios against HF.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


def bench_zipage(llm, batch: int, new_tokens: int, runs: int) -> float:
    from zipage_jax import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [PROMPT] * batch
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles every bucket this batch uses
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert all(len(o["token_ids"]) == new_tokens for o in outs)
    return batch * new_tokens / statistics.median(times)


def bench_hf(model, tokenizer, batch: int, new_tokens: int, runs: int) -> float:
    import torch

    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]] * batch)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id)
    times = []
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        for _ in range(runs):
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
    return batch * new_tokens / statistics.median(times)


def bench_llama_cpp(gguf_path: str, new_tokens: int, runs: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=gguf_path, n_ctx=512, n_threads=os.cpu_count(), verbose=False)
    llm(PROMPT, max_tokens=4, temperature=0)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = llm(PROMPT, max_tokens=new_tokens, temperature=0, ignore_eos=True)
        times.append(time.perf_counter() - start)
        assert out["usage"]["completion_tokens"] == new_tokens
    return new_tokens / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from zipage_jax import LLM
    from zipage_jax.crosscheck.reference import load_reference_model

    llm = LLM(args.model, max_num_seqs=max(args.batches), kvcache_block_size=32)
    source = str(llm.engine.loaded.source)
    results: dict = {"model": source, "new_tokens": args.new_tokens, "runs": args.runs, "batches": {}}
    hf = None if args.skip_hf else load_reference_model(source)
    for batch in args.batches:
        row = {"zipage_tok_s": bench_zipage(llm, batch, args.new_tokens, args.runs)}
        if hf is not None:
            row["hf_tok_s"] = bench_hf(hf, llm.tokenizer, batch, args.new_tokens, args.runs)
            row["ratio_vs_hf"] = row["zipage_tok_s"] / row["hf_tok_s"]
        results["batches"][str(batch)] = row
        print(f"batch {batch:3d}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), file=sys.stderr)
    if source.endswith(".gguf"):
        cpp = bench_llama_cpp(source, args.new_tokens, args.runs)
        if cpp is not None:
            results["llama_cpp_tok_s_batch1"] = cpp
            if "1" in results["batches"]:
                results["batches"]["1"]["ratio_vs_llama_cpp"] = results["batches"]["1"]["zipage_tok_s"] / cpp
    print(json.dumps(results) if args.json else json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
