"""Scores of forced jobs against full KV's: perplexity ratios, pass keys and greedy agreement."""

from __future__ import annotations

import math

import numpy as np

from zipage_jax.evals.forcing import Job, JobResult


def nll(job: Job, result: JobResult) -> tuple[float, int]:
    """The negative log-likelihood of the job's scored forced tokens, and their number."""
    mask = np.ones(len(job.forced), bool) if job.scored is None else job.scored
    return float(-result.logprobs[mask].sum()), int(mask.sum())


def passkey_correct(job: Job, result: JobResult) -> bool:
    """The generated digits start with the key."""
    return "".join(c for c in result.text if c.isdigit()).startswith(job.answer)


def summarise(policy: str, fraction: float, jobs: list[Job], results: list[JobResult],
              full: list[JobResult]) -> dict:
    """Pooled over the jobs: the text and reasoning ppl_ratio (full-KV perplexity / the policy's,
    and each text kind's, and each job's), passkey accuracy and greedy agreement."""
    by_workload: dict[str, list[float]] = {}  # name -> [nll policy, nll full, tokens]
    agree, total, passkeys = 0, 0, []
    for job, res, ref in zip(jobs, results, full, strict=True):
        if job.kind == "passkey":
            passkeys.append(passkey_correct(job, res))
            continue
        mine, n = nll(job, res)
        theirs, _ = nll(job, ref)
        names = ["reasoning"] if job.kind == "reasoning" else ["text", f"text:{job.kind}"]
        for name in [*names, f"job:{job.workload}"]:
            acc = by_workload.setdefault(name, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + mine, acc[1] + theirs, acc[2] + n
        if job.free:
            agree += sum(1 for a, b in zip(res.generated, ref.generated, strict=False) if a == b)
            total += len(ref.generated)
    ratios = {name: math.exp((full_nll - mine) / n) for name, (mine, full_nll, n) in by_workload.items() if n}
    ppls = {name: math.exp(mine / n) for name, (mine, _, n) in by_workload.items() if n}
    return {
        "policy": policy,
        "budget_fraction": fraction,
        "ppl_ratio": ratios.get("text"),
        "reasoning_ppl_ratio": ratios.get("reasoning"),
        "passkey_accuracy": sum(passkeys) / len(passkeys) if passkeys else None,
        "agreement": agree / total if total else None,
        "ppl": ppls.get("text"),
        "reasoning_ppl": ppls.get("reasoning"),
        "ppl_ratio_by_kind": {name[5:]: r for name, r in ratios.items() if name.startswith("text:")},
        "ppl_ratio_by_job": {name[4:]: r for name, r in ratios.items() if name.startswith("job:")},
    }
