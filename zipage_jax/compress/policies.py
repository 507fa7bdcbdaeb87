"""The eviction policies: which tokens a full sequence keeps (docs/ALGORITHM.md section 5).

A policy is one `Policy`: its name, how it scores tokens, and its default options (how many
attention sinks and what share of the budget it protects as the most recent tokens). Everything
that names or validates a policy reads `POLICIES`: the engine config, SamplingParams, the
scoring, the runner, the server and the evaluation script.

Every policy keeps exactly `budget` tokens per (sequence, layer, kv head): the `sinks` first
tokens and the `recent` last ones are protected (+inf), the rest of the budget goes to the best
scored tokens. With `recent_fraction = 0` the recent window is the query tail (the last
`query_cache_len` positions), which is the reference's rule.

A request's policy, options and budget are resolved once, when it is admitted, into a
`KVBudget` carried by each of its sequences: the scheduler and the runner only read it.

- "zipage": the reference (Zipage, arXiv 2603.08743), golden-checked: the attention of the
  cached queries, then the engine's global score, pooling and redundancy stages; sinks only
  when `sink_len` asks for them.
- "streaming": StreamingLLM (Xiao et al., ICLR 2024): 4 sinks and the most recent tokens; the
  score is the position.
- "window": the reference's score plus 4 sinks and 75% of the budget as a protected recent
  window. H2O (Zhang et al., NeurIPS 2023) splits its budget between heavy hitters and recent
  tokens, SnapKV (Li et al., 2024) keeps its observation window; 16 cached queries estimate
  long-range importance noisily, so a fixed share of the budget goes to the recent past, which
  the next tokens depend on most. The share was chosen on the dev texts (docs/RESULTS.md).
- "vnorm-window": "window" with each token's attention score multiplied by the L2 norm of its
  value (VATP: Guo et al., EMNLP 2024): a token adds attention * value to the output, so a
  heavily attended token with a small value (sinks, punctuation) matters less.
- "rkv": R-KV (Cai et al., arXiv 2505.24133): importance minus redundancy,
  `lambda * attention - (1 - lambda) * redundancy` with lambda = 0.1, both normalised over the
  sequence; a key's redundancy is the softmax of its cosine similarity to the other keys (the
  reference's "raw" redundancy stage), so of several near-copies (repeated reasoning steps)
  only some are kept. 4 sinks and a protected recent window.
- "triattention": TriAttention-style (Mao et al., arXiv 2604.04921; `compress/future.py`): the
  attention that future queries 1 to 4096 tokens ahead are predicted to give each key, from the
  RoPE-rotated centre of the cached queries, so a key is judged by where the head's queries
  point, not only by what the last 16 queries looked at. 4 sinks and a protected recent window.
- "vnorm-prompt": "vnorm-window" that never forgets the question: half of the budget is reserved
  for the prompt's best tokens and a quarter for the recent past. An instruct model restates the
  prompt's signature and specification in its answer; a policy that lets generated tokens push
  the prompt out makes it rename the function, drop a condition or loop. Of the prompt tokens,
  those the answer has not yet quoted win over those it has (`compress/quotes.py`): a quoted line
  survives in the answer itself. Shares chosen by HumanEval pass@1 on the even problems.
The default is "vnorm-prompt", chosen by task accuracy on the dev problems (docs/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from zipage_jax.compress.auto_budget import AutoBudget


class Score(enum.IntEnum):
    """How a policy scores tokens before protection and top-k (a per-row value on the device)."""

    ATTENTION = 0  # attention of the cached queries, then the engine's global / pooling / redundancy stages
    VALUE_NORM = 1  # the same with the attention multiplied by each value's L2 norm first
    POSITION = 2  # later tokens score higher (no attention computed for the row)
    REDUNDANCY = 3  # R-KV: RKV_LAMBDA * attention - (1 - RKV_LAMBDA) * key redundancy
    FUTURE = 4  # predicted attention of future queries (compress/future.py), not the observed one


RKV_LAMBDA = 0.1  # R-KV's weight of importance against redundancy


@dataclass(frozen=True)
class PolicyOptions:
    sinks: int = 0  # first tokens always kept (attention sinks)
    recent_fraction: float = 0.0  # share of the budget kept as the most recent tokens (>= the query tail)
    prompt_fraction: float = 0.0  # share of the budget reserved for the best-scored prompt tokens


@dataclass(frozen=True)
class Policy:
    name: str
    score: Score
    defaults: PolicyOptions

    @property
    def has_recent_window(self) -> bool:
        return self.defaults.recent_fraction > 0

    @property
    def has_prompt_reserve(self) -> bool:
        return self.defaults.prompt_fraction > 0

    def options(self, sink_len: int | None = None, recent_fraction: float | None = None,
                prompt_fraction: float | None = None) -> PolicyOptions:
        """The defaults with the engine's overrides (None keeps the policy's own); recent_fraction
        and prompt_fraction only change the policies that have a recent window / a prompt reserve."""
        recent, prompt = self.defaults.recent_fraction, self.defaults.prompt_fraction
        if recent_fraction is not None and self.has_recent_window:
            recent = recent_fraction
        if prompt_fraction is not None and self.has_prompt_reserve:
            prompt = prompt_fraction
        return PolicyOptions(self.defaults.sinks if sink_len is None else sink_len, recent, prompt)


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("zipage", Score.ATTENTION, PolicyOptions(sinks=0, recent_fraction=0.0)),
    Policy("streaming", Score.POSITION, PolicyOptions(sinks=4, recent_fraction=0.0)),
    Policy("window", Score.ATTENTION, PolicyOptions(sinks=4, recent_fraction=0.75)),
    Policy("vnorm-window", Score.VALUE_NORM, PolicyOptions(sinks=4, recent_fraction=0.75)),
    Policy("rkv", Score.REDUNDANCY, PolicyOptions(sinks=4, recent_fraction=0.75)),
    Policy("triattention", Score.FUTURE, PolicyOptions(sinks=4, recent_fraction=0.75)),
    Policy("vnorm-prompt", Score.VALUE_NORM, PolicyOptions(sinks=4, recent_fraction=0.25, prompt_fraction=0.5)),
)}
DEFAULT_POLICY = "vnorm-prompt"  # chosen by HumanEval pass@1 on the dev problems; "zipage" = reference


def get_policy(name: object) -> Policy:
    """The policy called `name`; ValueError naming the choices otherwise."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"eviction_policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]


def num_recent(options: PolicyOptions, budget_tokens: int, query_cache_len: int) -> int:
    """Protected most recent tokens: a share of the budget, never fewer than the query tail."""
    return max(query_cache_len, int(options.recent_fraction * budget_tokens))


@dataclass(frozen=True)
class KVBudget:
    """What one sequence keeps when it compresses, resolved at admission (`resolve_budget`)."""

    policy: Policy
    blocks: int  # M: the sequence compresses when it fills block M + 1
    tokens: int  # M * block size: tokens kept per (layer, kv head)
    sinks: int  # first positions protected
    recent: int  # last positions protected
    prompt_reserve: int = 0  # the best-scored prompt tokens protected (sinks among them)
    deferred: bool = False  # a long prompt compacts once, at its end, not between chunks (engine/prompt_compaction.py)
    auto: AutoBudget | None = None  # kv_budget="auto": `blocks` changes at each compaction point
    options: PolicyOptions | None = None  # what `resized` resolves with (automatic budgets)
    prompt_on_top: int = 0  # keep_prompt: the prompt's tokens, kept whole beside the budget

    def resized(self, blocks: int, block_size: int, query_cache_len: int) -> KVBudget:
        """This automatic budget at `blocks` blocks in all: its protected tokens follow its size
        (with keep_prompt, the size of what it keeps beside the prompt)."""
        prompt_blocks = -(-self.prompt_on_top // block_size)
        budget = resolve_budget(self.policy, self.options, blocks - prompt_blocks, block_size, query_cache_len)
        if self.prompt_on_top:
            budget = keep_prompt_on_top(budget, self.prompt_on_top, block_size)
        return dataclasses.replace(budget, deferred=self.deferred, auto=self.auto, options=self.options)


def resolve_budget(policy: Policy, options: PolicyOptions, blocks: int, block_size: int,
                   query_cache_len: int) -> KVBudget:
    """The budget of `blocks` blocks under `policy`; ValueError when it cannot hold what the
    policy protects (sinks, recent window and prompt reserve)."""
    tokens = blocks * block_size
    recent = num_recent(options, tokens, query_cache_len)
    reserve = max(options.sinks, int(options.prompt_fraction * tokens)) if options.prompt_fraction else 0
    protected = max(options.sinks, reserve) + recent
    if tokens < protected:
        raise ValueError(f"kv_budget of {tokens} tokens cannot hold the {protected} tokens policy "
                         f"{policy.name!r} protects (sinks, recent window and prompt reserve)")
    return KVBudget(policy, blocks, tokens, options.sinks, recent, reserve)


def keep_prompt_on_top(budget: KVBudget, prompt_len: int, block_size: int) -> KVBudget:
    """`budget` with the prompt kept whole beside it (keep_prompt): its blocks plus the prompt's
    (rounded up), every prompt token in the prompt reserve."""
    blocks = budget.blocks + -(-prompt_len // block_size)
    return dataclasses.replace(budget, blocks=blocks, tokens=blocks * block_size,
                               prompt_reserve=max(prompt_len, budget.sinks), prompt_on_top=prompt_len)


class CompressRows(NamedTuple):
    """Per sequence of a compression batch, what its policy and budget ask for ([B] arrays)."""

    budget: np.ndarray  # int32 tokens kept per (layer, kv head); 0 on padding rows
    sinks: np.ndarray  # int32 first positions protected
    recent: np.ndarray  # int32 last positions protected
    score: np.ndarray  # int32 Score
    prompt_reserve: np.ndarray  # int32 best-scored prompt tokens protected
    prompt_len: np.ndarray  # int32 the prompt's tokens: positions < prompt_len are the prompt's
    position_offset: np.ndarray  # int32 position - slot of the tokens written since the last compaction
    quote_end: np.ndarray  # int32 the answer has quoted the prompt up to here (compress/quotes.py)
    in_prompt: np.ndarray  # int32 1: the sequence has computed no output yet (scores max-pooled, prompt_pooling_size)
    # int32 blocks a compressed sequence kept at its last compaction: the history its global score
    # and positions come from (an automatic budget's size may have changed since)
    history: np.ndarray


@dataclass(frozen=True)
class RowSequence:
    """What a compression row needs of its sequence besides the budget."""

    prompt_len: int  # tokens of the prompt
    evicted: int  # tokens evicted so far (its position minus its slot, for the newest token)
    quote_end: int = 0  # prompt position the answer has quoted up to
    in_prompt: bool = False  # no output computed yet: a compaction of the prompt


def compress_rows(budgets: list[KVBudget | None], batch_size: int | None = None,
                  sequences: list[RowSequence] | None = None) -> CompressRows:
    """Host arrays for a compression batch, padded to `batch_size` rows; padding rows (and None)
    keep nothing. `sequences` (default: prompts of 0 tokens, nothing evicted) pairs with `budgets`;
    given, their rows move a reserve the prompt cannot fill to the recent window
    (`unfillable_reserve_to_recent`)."""
    rows = CompressRows(*np.zeros((len(CompressRows._fields), batch_size or len(budgets)), np.int32))
    live = [i for i, budget in enumerate(budgets) if budget is not None]
    picked = [budgets[i] for i in live]
    seqs = [sequences[i] for i in live] if sequences is not None else [RowSequence(0, 0)] * len(live)
    set_compress_rows(
        rows, np.asarray(live, np.int64),
        budget=[b.tokens for b in picked], sinks=[b.sinks for b in picked], recent=[b.recent for b in picked],
        score=[int(b.policy.score) for b in picked], prompt_reserve=[b.prompt_reserve for b in picked],
        prompt_len=[q.prompt_len for q in seqs], position_offset=[q.evicted for q in seqs],
        quote_end=[q.quote_end for q in seqs], in_prompt=[q.in_prompt for q in seqs],
        history=[b.blocks for b in picked])
    if sequences is not None:
        unfillable_reserve_to_recent(rows, np.asarray(live, np.int64))
    return rows


def set_compress_rows(rows: CompressRows, at: np.ndarray | slice, **fields) -> None:
    """Sets rows `at` of `rows` from `fields` (one value per row for every field of CompressRows)."""
    for name in CompressRows._fields:
        getattr(rows, name)[at] = fields[name]


def unfillable_reserve_to_recent(rows: CompressRows, at: np.ndarray | slice) -> None:
    """The rule for a prompt reserve the prompt cannot fill (a short prompt, teacher-forced text):
    rows `at` protect the part of their reserve beyond their prompt (and sinks) as recent tokens
    instead, so the protected tokens never exceed the ones admission checked the budget holds.
    Apply it once the rows' budgets and prompt lengths are set."""
    rows.recent[at] += np.maximum(0, rows.prompt_reserve[at] - np.maximum(rows.prompt_len[at], rows.sinks[at]))
