"""What a task evaluation compares: full KV and `policy@budget` configs, every one a per-request
budget in one engine, and the per-split table of pass@1, generated tokens and peak KV that
`eval code` and `eval math` print.

A budget is a token count or "auto" (compress/auto_budget.py); "full" is always the first config
and the reference of every ratio.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from zipage_jax.compress.auto_budget import AUTO, Budget, parse_budget
from zipage_jax.compress.policies import POLICIES

FULL_KV = "full"
# a config's suffix: the prompt kept whole beside its budget, or bounded by it (no suffix: the engine's choice)
KEEP_PROMPT = {"+keep_prompt": True, "+no_keep_prompt": False}


@dataclass(frozen=True)
class EvalConfig:
    policy: str  # FULL_KV or an eviction policy
    budget: Budget  # kv_budget: tokens or "auto"; 0 with FULL_KV
    keep_prompt: bool | None = None  # SamplingParams.keep_prompt

    @property
    def name(self) -> str:
        if self.policy == FULL_KV:
            return FULL_KV
        suffix = {keep: suffix for suffix, keep in KEEP_PROMPT.items()}.get(self.keep_prompt, "")
        return f"{self.policy}@{self.budget}{suffix}"

    def sampling_params(self, max_tokens: int):
        """Greedy decoding under this config's budget and policy."""
        from zipage_jax import SamplingParams

        full = self.policy == FULL_KV
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, kv_budget=self.budget,
                              eviction_policy=None if full else self.policy, keep_prompt=self.keep_prompt)


def configs(policies: Sequence[str], budgets: Sequence[Budget], keep_prompt: bool | None = None) -> list[EvalConfig]:
    """Full KV, then every policy at every budget."""
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    for budget in budgets:
        if budget != AUTO and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budgets must be positive token counts or {AUTO!r}, got {budget!r}")
    return [EvalConfig(FULL_KV, 0)] + [EvalConfig(p, b, keep_prompt) for p in policies for b in budgets]


def parse_configs(pairs: Sequence[str]) -> list[EvalConfig]:
    """Full KV, then each "policy@budget[+keep_prompt|+no_keep_prompt]", validated as `configs`
    validates."""
    out = [EvalConfig(FULL_KV, 0)]
    for pair in pairs:
        suffix = next((s for s in KEEP_PROMPT if pair.endswith(s)), "")
        policy, _, budget = pair.removesuffix(suffix).partition("@")
        try:
            out += configs([policy], [parse_budget(budget)], KEEP_PROMPT.get(suffix))[1:]  # 0 is refused there
        except ValueError as exc:
            raise ValueError(f"a config is POLICY@BUDGET, with +keep_prompt to keep the prompt whole beside the "
                             f"budget or +no_keep_prompt to bound it too (e.g. vnorm-prompt@128+keep_prompt or "
                             f"vnorm-prompt@auto+no_keep_prompt), got {pair!r}: {exc}") from exc
    return out


def summarize(eval_configs: Sequence[EvalConfig], ids_by_split: Mapping[str, Sequence[str]], answers: Mapping,
              passed: Callable[[str, str], bool], block_size: int) -> dict[str, list[dict]]:
    """Per split, one row per config: passes, pass@1 and its ratio to full KV's, mean generated
    tokens, answers cut at max_tokens, mean peak KV tokens per sequence (`kv_blocks_peak` blocks)
    and their ratios to full KV's. `answers[(config name, id)]` is the engine's output dict."""
    table = {}
    for split, ids in ids_by_split.items():
        if not ids:
            continue
        rows = []
        for c in eval_configs:
            outs = [answers[c.name, i] for i in ids]
            rows.append({
                "config": c.name, "policy": c.policy, "budget": c.budget, "problems": len(ids),
                "passed": sum(passed(c.name, i) for i in ids),
                "mean_generated_tokens": sum(len(o["token_ids"]) for o in outs) / len(ids),
                "cut_at_max_tokens": sum(o["finish_reason"] == "length" for o in outs),
                "mean_peak_kv_tokens": sum(o["metrics"]["kv_blocks_peak"] for o in outs) * block_size / len(ids),
                "passed_ids": [i for i in ids if passed(c.name, i)],
            })
        full = rows[0]
        for row in rows:
            row["pass_at_1"] = row["passed"] / row["problems"]
            row["pass_ratio"] = row["passed"] / full["passed"] if full["passed"] else None
            row["tokens_ratio"] = row["mean_generated_tokens"] / full["mean_generated_tokens"]
            row["peak_kv_ratio"] = row["mean_peak_kv_tokens"] / full["mean_peak_kv_tokens"]
        table[split] = rows
    return table


def format_table(table: dict[str, list[dict]], max_tokens: int) -> str:
    lines = []
    for split, rows in table.items():
        lines.append(f"{split} ({rows[0]['problems']} problems)")
        lines.append(f"{'config':<22} {'pass@1':>7} {'vs full':>8} {'gen tok':>8} {'vs full':>8} "
                     f"{'cut@' + str(max_tokens):>8} {'peak KV':>8} {'vs full':>8}")
        for r in rows:
            ratio = "-" if r["pass_ratio"] is None else f"{r['pass_ratio']:.2f}"
            lines.append(f"{r['config']:<22} {r['passed']:>3}/{r['problems']:<3} {ratio:>8} "
                         f"{r['mean_generated_tokens']:>8.1f} {r['tokens_ratio']:>8.2f} {r['cut_at_max_tokens']:>8} "
                         f"{r['mean_peak_kv_tokens']:>8.1f} {r['peak_kv_ratio']:>8.2f}")
    return "\n".join(lines)


def _flag(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"true or false, got {text!r}")
    return text == "true"


# the engine options a task evaluation takes, with its defaults (the others are the engine's)
ENGINE_DEFAULTS = {"kvcache_block_size": 16, "max_num_seqs": 64, "kvcache_memory_gb": 4.0}
ENGINE_OVERRIDES = {"sink_len": (int, "override every policy's sinks"),
                    "recent_fraction": (float, "override the policies' recent share"),
                    "prompt_fraction": (float, "override the policies' prompt reserve"),
                    "auto_budget_threshold": (float, "auto budgets: the largest attention share a compaction evicts"),
                    "auto_budget_min": (int, "auto budgets: the fewest tokens kept, and the growth step"),
                    "auto_budget_max": (int, "auto budgets: the most tokens kept"),
                    "auto_budget_keeps_prompt": (_flag, "auto budgets: the prompt kept whole beside them "
                                                        "(true/false)")}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for name, default in ENGINE_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    for name, (kind, doc) in ENGINE_OVERRIDES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=doc)


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine options `add_engine_arguments` parsed (those left unset: the engine's defaults)."""
    return {**{k: getattr(args, k) for k in ENGINE_DEFAULTS},
            **{k: v for k in ENGINE_OVERRIDES if (v := getattr(args, k)) is not None}}
