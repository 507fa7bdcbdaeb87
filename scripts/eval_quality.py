"""Quality of compressed KV vs full KV, through the engine's own decode path.

    python scripts/eval_quality.py [--quick] [--json] [--policies full streaming zipage-attn zipage ...]
                                   [--budgets 0.0625 0.125 0.25 0.5] [--length 2048] [--text FILE ...]

Workloads, each run for every policy at every budget (a fraction of the context length), all
sequences of one policy batched in one engine (per-request `kv_budget`):
  (a) teacher-forced perplexity: a short prompt, then every further token of the text is forced
      as the "sampled" token of a decode step, so compression happens exactly as in generation
      (texts: long files of the Python standard library, or --text FILE...);
      reasoning: step-by-step answers the model wrote itself with full KV, forced back the same way;
  (b) passkey: a number stated early in a filler, forced through decode, then asked for at the
      end and generated greedily;
  (c) greedy agreement: after each forced text, the share of the next N greedy tokens identical
      to full KV's.
ppl_ratio = full-KV perplexity / compressed perplexity over the same tokens (1.0 = no loss).
The last line with --json is {"results": [{"policy", "budget_fraction", "ppl_ratio", ...}, ...]}.

Teacher forcing is the engine's own: `SamplingParams(forced_token_ids=...)` decodes the forced
tokens one per step (so compression runs as in generation) and reports their log-probabilities
from the full distribution. Policies that differ only in `eviction_policy` (a per-request
option) share one engine; the others get one engine each (see VARIANTS).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zipage_jax.compress.policies import POLICIES

# name -> options: eviction_policy goes to each request, the rest to the engine (over
# engine_options' base, where use_global_score is off). Every policy of the registry under its
# own name with the global score (the engine's default scoring), except "zipage", which is the
# reference's recommended setting; then the ablations.
VARIANTS = {"full": {}, **{name: dict(eviction_policy=name, use_global_score=True) for name in POLICIES}} | {
    "zipage": dict(eviction_policy="zipage", use_global_score=True, enable_pooling=True, redundancy="lightning"),
    "zipage-attn": dict(eviction_policy="zipage"),  # attention only
    "zipage-global": dict(eviction_policy="zipage", use_global_score=True),
    "window-attn": dict(eviction_policy="window"),  # without the global score
    "window-25": dict(eviction_policy="window", use_global_score=True, recent_fraction=0.25),
    "window-50": dict(eviction_policy="window", use_global_score=True, recent_fraction=0.5),
    "window-pool": dict(eviction_policy="window", use_global_score=True, enable_pooling=True),
    "vnorm-window-attn": dict(eviction_policy="vnorm-window"),
}
DEFAULT_POLICIES = ["full", "streaming", "zipage-attn", "zipage", "window", "vnorm-window"]
BUDGETS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
STDLIB_TEXTS = ("argparse.py", "pydoc_data/topics.py")  # source code; English documentation
PROMPT_TOKENS = 16  # tokens prefilled before forcing starts
AGREEMENT_TOKENS = 32
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PROBLEMS = (
    "A farmer has 17 sheep and buys 3 pens. He puts the same number of sheep in each pen and keeps the rest "
    "in the barn. How many sheep can go in each pen, and how many stay in the barn?",
    "A train leaves at 9:40 and arrives at 13:05. It stops twice for 12 minutes each. How long is it moving?",
    "Tom reads 23 pages a day. His book has 412 pages and he has read for 9 days. How many days are left?",
    "A shop sells pens at 3 for 2 dollars. Anna buys 14 pens. How much does she pay if single pens cost 1 dollar?",
    "A rectangle is 3 times as long as it is wide and its perimeter is 96 cm. What is its area?",
    "Sam has twice as many marbles as Lea. Together they have 57. Lea gives Sam 4. How many does each have now?",
    "A tank holds 240 litres. One pipe fills it in 6 hours and another empties it in 10. How long to fill it?",
    "The average of five numbers is 18. Four of them are 12, 25, 9 and 20. What is the fifth?",
)


@dataclass
class Job:
    """One sequence: prefill `prompt`, force `forced`, then generate `free` greedy tokens."""

    workload: str
    prompt: list[int]
    forced: list[int]
    free: int = 0
    scored: np.ndarray | None = None  # bool per forced token: counted in the perplexity (default all)
    answer: str = ""  # passkey: the expected digits


@dataclass
class JobResult:
    logprobs: np.ndarray  # of the forced tokens
    generated: list[int]  # the free tokens
    text: str = ""


# -- teacher forcing through the engine ----------------------------------------------------------


def engine_group(policy: str) -> tuple:
    """The engine options a policy needs (everything but the per-request eviction_policy)."""
    return tuple(sorted((k, v) for k, v in VARIANTS[policy].items() if k != "eviction_policy"))


def teacher_force(llm, jobs: list[Job], budgets: list[int], policies: list[str]) -> list[JobResult]:
    """Runs `jobs` at once; budgets[i], policies[i]: kv_budget tokens (0 = full KV) and policy of
    jobs[i], whose engine options must be `llm`'s (see engine_group)."""
    from zipage_jax import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=len(job.forced) + job.free, ignore_eos=True, logprobs=0,
                             kv_budget=budget, eviction_policy=VARIANTS[policy].get("eviction_policy"),
                             forced_token_ids=job.forced)
              for job, budget, policy in zip(jobs, budgets, policies)]
    outs = llm.generate([job.prompt for job in jobs], params, use_tqdm=False)
    results = []
    for job, out in zip(jobs, outs):
        n = len(job.forced)
        logprobs = np.array([lp["logprob"] for lp in out["logprobs"][:n]], np.float64)
        free = out["token_ids"][n:]
        results.append(JobResult(logprobs, free, llm.tokenizer.decode(free)))
    return results


# -- workloads ---------------------------------------------------------------------------------


def stdlib_path(name: str) -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"]) / name


def text_jobs(tokenizer, files: list[Path], length: int) -> list[Job]:
    jobs = []
    for path in files:
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"][:length]
        if len(ids) < 4 * PROMPT_TOKENS:
            raise ValueError(f"{path} has only {len(ids)} tokens; need at least {4 * PROMPT_TOKENS}")
        jobs.append(Job(f"text:{path.name}", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=AGREEMENT_TOKENS))
    return jobs


def passkey_jobs(tokenizer, length: int, trials: int, seed: int = 0) -> list[Job]:
    """A 5-digit key stated after ~10% of the filler, asked for at the end (forced), answered greedily."""
    rng = random.Random(seed)
    filler = tokenizer(PASSKEY_FILLER)["input_ids"]
    question = tokenizer("What is the pass key? The pass key is")["input_ids"]
    intro = tokenizer("There is important info hidden inside a lot of irrelevant text. Find it and memorize "
                      "it. I will quiz you about the important information there. ")["input_ids"]
    jobs = []
    for _ in range(trials):
        key = str(rng.randint(10000, 99999))
        needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ")["input_ids"]
        room = length - len(intro) - len(needle) - len(question)
        reps = max(1, room // len(filler))
        before = max(1, reps // 10)
        ids = intro + filler * before + needle + filler * (reps - before) + question
        jobs.append(Job("passkey", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=6, answer=key))
    return jobs


def passkey_correct(job: Job, result: JobResult) -> bool:
    return "".join(c for c in result.text if c.isdigit()).startswith(job.answer)


def reasoning_job(llm, length: int, seed: int = 0) -> Job:
    """A multi-turn conversation of word problems the model answers step by step with full KV
    (temperature 0.6, top-p 0.95, seeded) until `length` tokens; cached on disk by its inputs."""
    from zipage_jax import SamplingParams
    from zipage_jax.models.param_cache import default_cache_dir

    key = hashlib.sha256(json.dumps([llm.engine.loaded.source, length, seed, PROBLEMS]).encode()).hexdigest()[:16]
    cache = default_cache_dir() / f"reasoning-{key}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        ids, mask = data["ids"], data["mask"]
    else:
        messages, ids, mask = [], [], []
        for turn in range(64):
            problem = PROBLEMS[turn % len(PROBLEMS)]
            messages.append({"role": "user", "content": f"{problem} Think step by step, then give the answer."})
            prompt = llm.apply_chat_template(messages)
            room = length - len(prompt)
            if room < 32:
                break
            out = llm.generate([prompt], SamplingParams(temperature=0.6, top_p=0.95, seed=seed + turn,
                                                        max_tokens=min(room, 512), kv_budget=0), use_tqdm=False)[0]
            mask += [False] * (len(prompt) - len(ids)) + [True] * len(out["token_ids"])
            ids = prompt + out["token_ids"]
            messages.append({"role": "assistant", "content": out["text"]})
        ids, mask = ids[:length], mask[:length]
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"ids": ids, "mask": mask}))
    return Job("reasoning", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], scored=np.array(mask[PROMPT_TOKENS:], bool))


# -- evaluation --------------------------------------------------------------------------------


def engine_options(args, group: tuple = ()) -> dict:
    return dict(kvcache_block_size=args.block_size, query_cache_len=args.query_cache_len,
                max_num_batched_tokens=max(2048, args.length), max_model_len=args.length + 64,
                **{"use_global_score": False, **dict(group)})


def pool_blocks(jobs: list[Job], budgets: list[int], block_size: int) -> int:
    """Every job at its peak at once, plus the dummy block (and room for one longest job)."""
    longest = max(len(j.prompt) + len(j.forced) + j.free for j in jobs)
    total = 2 + -(-longest // block_size)
    for job, budget in zip(jobs, budgets):
        length = len(job.prompt) + len(job.forced) + job.free
        total += -(-length // block_size) + 1 if budget == 0 else -(-budget // block_size) + 1
    return total


def make_llm(loaded, args, num_blocks: int, max_num_seqs: int, group: tuple = ()):
    from zipage_jax import LLM
    from zipage_jax.engine.llm_engine import LLMEngine

    llm = LLM.__new__(LLM)  # one loaded model shared by every engine
    llm.engine = LLMEngine(loaded=loaded, num_kvcache_blocks=num_blocks, max_num_seqs=max_num_seqs,
                           **engine_options(args, group))
    llm.tokenizer = llm.engine.tokenizer
    return llm


def run_batch(loaded, args, jobs: list[Job], budgets: list[int], policies: list[str]) -> tuple[list[JobResult], float]:
    """One engine per group of policies that share engine options, each running its jobs at once."""
    results: list[JobResult | None] = [None] * len(jobs)
    start = time.perf_counter()
    for group in dict.fromkeys(engine_group(p) for p in policies):
        idx = [i for i, p in enumerate(policies) if engine_group(p) == group]
        mine = [jobs[i] for i in idx]
        llm = make_llm(loaded, args, pool_blocks(mine, [budgets[i] for i in idx], args.block_size), len(mine), group)
        for i, res in zip(idx, teacher_force(llm, mine, [budgets[i] for i in idx], [policies[i] for i in idx])):
            results[i] = res
    return results, time.perf_counter() - start


def full_kv_results(loaded, args, jobs: list[Job]) -> tuple[list[JobResult], float]:
    """Full KV does not depend on the policies: cached on disk by the model and the jobs."""
    from zipage_jax.models.param_cache import default_cache_dir

    key = hashlib.sha256(json.dumps([loaded.source, args.block_size, [(j.prompt, j.forced, j.free) for j in jobs]])
                         .encode()).hexdigest()[:16]
    cache = default_cache_dir() / f"eval-full-{key}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        return [JobResult(np.array(d["logprobs"]), d["generated"], d["text"]) for d in data], 0.0
    results, seconds = run_batch(loaded, args, jobs, [0] * len(jobs), ["full"] * len(jobs))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps([{"logprobs": r.logprobs.tolist(), "generated": r.generated, "text": r.text}
                                 for r in results]))
    return results, seconds


def nll(job: Job, result: JobResult) -> tuple[float, int]:
    mask = np.ones(len(job.forced), bool) if job.scored is None else job.scored
    return float(-result.logprobs[mask].sum()), int(mask.sum())


def summarise(policy: str, fraction: float, jobs: list[Job], results: list[JobResult],
              full: list[JobResult]) -> dict:
    by_workload: dict[str, list[float]] = {}  # name -> [nll policy, nll full, tokens]
    agree, total, passkeys = 0, 0, []
    for job, res, ref in zip(jobs, results, full):
        if job.workload == "passkey":
            passkeys.append(passkey_correct(job, res))
            continue
        mine, n = nll(job, res)
        theirs, _ = nll(job, ref)
        acc = by_workload.setdefault("reasoning" if job.workload == "reasoning" else "text", [0.0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + mine, acc[1] + theirs, acc[2] + n
        if job.free:
            agree += sum(1 for a, b in zip(res.generated, ref.generated) if a == b)
            total += len(ref.generated)
    ratios = {name: math.exp((full_nll - mine) / n) for name, (mine, full_nll, n) in by_workload.items()}
    ppls = {name: math.exp(mine / n) for name, (mine, _, n) in by_workload.items()}
    return {
        "policy": policy,
        "budget_fraction": fraction,
        "ppl_ratio": ratios.get("text"),
        "reasoning_ppl_ratio": ratios.get("reasoning"),
        "passkey_accuracy": sum(passkeys) / len(passkeys) if passkeys else None,
        "agreement": agree / total if total else None,
        "ppl": ppls.get("text"),
        "reasoning_ppl": ppls.get("reasoning"),
    }


def evaluate(args) -> list[dict]:
    """One engine run for full KV, then one per budget with every policy batched together."""
    from zipage_jax.models.loading import load_model

    log = functools.partial(print, file=sys.stderr, flush=True)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    files = [Path(f) for f in args.text] if args.text else [stdlib_path(n) for n in STDLIB_TEXTS[: args.num_texts]]
    jobs = text_jobs(tok, files, args.length)
    if not args.text:
        jobs += passkey_jobs(tok, args.length, args.passkey_trials)
        if args.reasoning:
            jobs.append(reasoning_job(make_llm(loaded, args, 4 + args.length // args.block_size, 1), args.length))
    context = max(len(j.prompt) + len(j.forced) for j in jobs)
    budgets = {f: _budget_tokens(f, context, args.block_size, args.query_cache_len) for f in args.budgets}
    log(f"{len(jobs)} jobs, context {context} tokens, budgets {budgets}")

    full, seconds = full_kv_results(loaded, args, jobs)
    log(f"full KV: {seconds:.0f}s")
    rows = [summarise("full", 1.0, jobs, full, full)]
    policies = [p for p in args.policies if p != "full"]
    for f in args.budgets:
        batch = [j for _ in policies for j in jobs]
        names = [p for p in policies for _ in jobs]
        results, seconds = run_batch(loaded, args, batch, [budgets[f]] * len(batch), names)
        for i, policy in enumerate(policies):
            row = summarise(policy, f, jobs, results[i * len(jobs):(i + 1) * len(jobs)], full)
            row["budget_tokens"] = budgets[f]
            rows.append(row)
            log(_format_row(row))
        log(f"budget {f}: {seconds:.0f}s")
    return rows


def _budget_tokens(fraction: float, context: int, block_size: int, query_cache_len: int) -> int:
    tokens = max(block_size, round(fraction * context / block_size) * block_size)
    if tokens < query_cache_len + 4:
        raise ValueError(f"budget {fraction} of {context} tokens is too small for the protected tokens")
    return tokens


def _format_row(row: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    return (f"{row['policy']:>14} {row['budget_fraction']:>7.4f} ppl_ratio {f(row['ppl_ratio'])} "
            f"reasoning {f(row['reasoning_ppl_ratio'])} passkey {f(row['passkey_accuracy'])} "
            f"agreement {f(row['agreement'])}")


def markdown_table(rows: list[dict]) -> str:
    head = "| policy | budget | ppl_ratio (text) | ppl_ratio (reasoning) | passkey | agreement |\n|---|---|---|---|---|---|\n"

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    return head + "".join(
        f"| {r['policy']} | {r['budget_fraction']:.4g} | {f(r['ppl_ratio'])} | {f(r['reasoning_ppl_ratio'])} | "
        f"{f(r['passkey_accuracy'])} | {f(r['agreement'])} |\n" for r in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true", help="a 1024-token context, one text, 2 passkeys, budget 1/8 only")
    p.add_argument("--json", action="store_true", help="last line: {\"results\": [...]}")
    p.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, choices=list(VARIANTS))
    p.add_argument("--budgets", nargs="+", type=float, default=None, help="fractions of the context")
    p.add_argument("--length", type=int, default=None, help="context tokens per sequence (default 2048)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="evaluate (a) on these files only")
    p.add_argument("--num-texts", type=int, default=len(STDLIB_TEXTS))
    p.add_argument("--passkey-trials", type=int, default=None)
    p.add_argument("--no-reasoning", dest="reasoning", action="store_false")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--query-cache-len", type=int, default=16)
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the table here")
    args = p.parse_args(argv)
    quick = args.quick
    args.length = args.length or (1024 if quick else 2048)
    args.budgets = args.budgets or ([1 / 8] if quick else list(BUDGETS))
    args.passkey_trials = args.passkey_trials if args.passkey_trials is not None else (2 if quick else 4)
    if quick and args.num_texts == len(STDLIB_TEXTS):
        args.num_texts = 1
    for f in args.budgets:
        if not 0 < f < 1:
            raise SystemExit(f"budgets are fractions in (0, 1), got {f}")
    for name in args.text or ():
        if not Path(name).is_file():
            raise SystemExit(f"--text: no such file {name}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = evaluate(args)
    table = markdown_table(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        print(json.dumps({"results": rows}))


if __name__ == "__main__":
    main()
