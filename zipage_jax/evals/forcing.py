"""Teacher forcing through the engine: a job prefills its prompt, then every forced token is the
"sampled" token of a decode step (`SamplingParams(forced_token_ids=...)`), so compression runs as
in generation, and the engine reports the forced tokens' log-probabilities from the full
distribution; then the job generates its free tokens greedily.

Jobs run batched, one engine per engine group (variants.engine_group) over one loaded model.
Full-KV results are cached on disk by the model and the jobs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from zipage_jax.compress.auto_budget import AUTO, Budget
from zipage_jax.evals.variants import VARIANTS, engine_group, group_engine_options
from zipage_jax.harness import build_llm, timed

WORKLOADS = ("text", "reasoning", "passkey")  # a row's flat length fields are those of its first present


@dataclass
class Job:
    """One sequence: prefill `prompt`, force `forced`, then generate `free` greedy tokens."""

    workload: str
    prompt: list[int]
    forced: list[int]
    free: int = 0
    scored: np.ndarray | None = None  # bool per forced token: counted in the perplexity (default all)
    answer: str = ""  # passkey: the expected digits
    kind: str = "text"  # a text's kind (code, docs, prose, ...), "reasoning" or "passkey"
    split: str = "dev"  # "dev" or "heldout"

    @property
    def context(self) -> int:
        """Tokens before the free ones: what its budget is a fraction of."""
        return len(self.prompt) + len(self.forced)


def workload_of(job: Job) -> str:
    return job.kind if job.kind in ("reasoning", "passkey") else "text"


@dataclass
class JobResult:
    logprobs: np.ndarray  # of the forced tokens
    generated: list[int]  # the free tokens
    text: str = ""
    peak_kv_tokens: int = 0  # the most KV it held at once (`kv_blocks_peak` blocks); 0 when read from the cache


def teacher_force(llm, jobs: list[Job], budgets: list[Budget], policies: list[str]) -> list[JobResult]:
    """Runs `jobs` at once; budgets[i], policies[i]: kv_budget (tokens, 0 = full KV, or "auto") and
    variant of jobs[i], whose engine options must be `llm`'s (see engine_group)."""
    return [job_result(llm, job, out) for job, out in zip(jobs, run_jobs(llm, jobs, budgets, policies), strict=True)]


def run_jobs(llm, jobs: list[Job], budgets: list[Budget], policies: list[str]) -> list[dict]:
    """`llm.generate`'s outputs for `jobs`: each prompt, its forced tokens (with their
    log-probabilities), then its free greedy tokens."""
    from zipage_jax import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=len(job.forced) + job.free, ignore_eos=True, logprobs=0,
                             kv_budget=budget, eviction_policy=VARIANTS[policy].get("eviction_policy"),
                             forced_token_ids=job.forced)
              for job, budget, policy in zip(jobs, budgets, policies, strict=True)]
    return llm.generate([job.prompt for job in jobs], params, use_tqdm=False)


def job_result(llm, job: Job, out: dict) -> JobResult:
    n = len(job.forced)
    logprobs = np.array([lp["logprob"] for lp in (out["logprobs"] or [])[:n]], np.float64)
    free = out["token_ids"][n:]
    peak = out["metrics"]["kv_blocks_peak"] * llm.engine.config.kvcache_block_size
    return JobResult(logprobs, free, llm.tokenizer.decode(free), peak)


def make_llm(loaded, args, num_blocks: int, max_num_seqs: int, group: tuple = ()):
    """An engine of `group` over the loaded model, for sequences of up to args.max_context tokens."""
    return build_llm(loaded=loaded, num_kvcache_blocks=num_blocks, max_num_seqs=max_num_seqs,
                     **group_engine_options(group, block_size=args.block_size, query_cache_len=args.query_cache_len,
                                            longest=args.max_context))


def pool_blocks(jobs: list[Job], budgets: list[Budget], block_size: int) -> int:
    """Every job at its peak at once (an automatic budget at its whole length), plus the dummy block
    (and room for one longest job)."""
    longest = max(len(j.prompt) + len(j.forced) + j.free for j in jobs)
    total = 2 + -(-longest // block_size)
    for job, budget in zip(jobs, budgets, strict=True):
        length = len(job.prompt) + len(job.forced) + job.free
        whole = budget == 0 or budget == AUTO
        total += -(-length // block_size) + 1 if whole else -(-budget // block_size) + 1
    return total


def run_batch(loaded, args, jobs: list[Job], budgets: list[Budget], policies: list[str],
              kv_cache_dtype: str = "auto") -> tuple[list[JobResult], float]:
    """The jobs' results and the seconds they took: one engine per group of variants that share
    engine options, each running its jobs at once."""
    return timed(lambda: _run_groups(loaded, args, jobs, budgets, policies, kv_cache_dtype))


def _run_groups(loaded, args, jobs: list[Job], budgets: list[Budget], policies: list[str],
                kv_cache_dtype: str) -> list[JobResult]:
    results: list[JobResult | None] = [None] * len(jobs)
    groups = [engine_group(p, kv_cache_dtype) for p in policies]
    for group in dict.fromkeys(groups):
        idx = [i for i, g in enumerate(groups) if g == group]
        mine = [jobs[i] for i in idx]
        llm = make_llm(loaded, args, pool_blocks(mine, [budgets[i] for i in idx], args.block_size), len(mine), group)
        mine_results = teacher_force(llm, mine, [budgets[i] for i in idx], [policies[i] for i in idx])
        for i, res in zip(idx, mine_results, strict=True):
            results[i] = res
    return results


def full_kv_results(loaded, args, jobs: list[Job]) -> tuple[list[JobResult], float]:
    """Full KV does not depend on the policies: cached on disk by the model and the jobs (0 seconds
    when cached)."""
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
