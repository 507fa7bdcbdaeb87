"""eval long-prompt's cases: prompts of exact lengths with pass keys at given depths, and texts to
continue, each a forcing.Job run once per point (a policy, a kv_budget and a prompt-compression mode)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from zipage_jax.evals.datasets import PASSKEY_INTRO, PASSKEY_NEEDLE, passkey_filler, passkeys, split_sources
from zipage_jax.evals.forcing import Job, JobResult

QUESTION = " What is the pass key? The pass key is"
SECOND_NEEDLE = " The door code is {key}. Remember it. {key} is the door code. "
TWO_QUESTIONS = " What is the pass key, and what is the door code? The pass key is"
TWO_QUESTION_FREE = 32  # greedy tokens answering both
TWO_QUESTION_KEYS = 100  # the door codes' key stream (datasets.passkeys)
SENTENCE_END = re.compile(r"[.!?\n]")

Point = tuple[str, int, str]  # (policy, kv_budget tokens, mode); full KV is ("full", 0, "full")
FULL: Point = ("full", 0, "full")


@dataclass
class Case:
    """One prompt of one task: `job` runs once per point."""

    task: str  # "passkey", "two-question" or "continuation"
    split: str
    length: int  # prompt tokens
    depth: float | tuple[float, float] | None  # passkey: asked for (two-question: both); None for continuation
    name: str  # passkey: "trial<k>"; two-question: the depths; continuation: the text's name
    job: Job
    actual_depth: float | tuple[float, ...] | None = None  # where each needle starts, of the prompt


@dataclass
class Outcome:
    result: JobResult
    metrics: dict = field(default_factory=dict)


def sentence_ends(tokenizer, filler: list[int]) -> list[bool]:
    """Per filler token: it ends a sentence or a line (the needle may follow it)."""
    return [bool(SENTENCE_END.search(tokenizer.decode([t]))) for t in filler]


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: str,
                   ends: list[bool] | None = None) -> tuple[list[int], float]:
    """Exactly `length` tokens: the intro, filler, the needle after the last sentence end before `depth`
    of the prompt (at `depth` if none is within 256 tokens), more filler, QUESTION. Returns the ids
    and where the needle starts, as a fraction of the prompt."""
    ids, (actual,) = needle_prompt(tokenizer, filler, length, [(depth, PASSKEY_NEEDLE.format(key=key))], QUESTION,
                                   ends)
    return ids, actual


def needle_prompt(tokenizer, filler: list[int], length: int, needles: list[tuple[float, str]], question: str,
                  ends: list[bool] | None = None) -> tuple[list[int], list[float]]:
    """Exactly `length` tokens: the intro, filler with each needle after the last sentence end before its
    depth, the question. Returns the ids and where each needle starts, as a fraction of the prompt."""
    intro = tokenizer(PASSKEY_INTRO)["input_ids"]
    texts = [tokenizer(text)["input_ids"] for _, text in needles]
    question_ids = tokenizer(question)["input_ids"]
    room = length - len(intro) - sum(map(len, texts)) - len(question_ids)
    if room < 1:
        raise ValueError(f"a passkey prompt of {length} tokens has no room for filler")
    hay = (filler * (room // len(filler) + 1))[:room]
    ends = sentence_ends(tokenizer, filler) if ends is None else ends
    cuts = []
    for depth, _ in needles:
        target = min(room, max(0, round(depth * length) - len(intro)))  # depth: of the prompt
        cuts.append(next((i + 1 for i in range(target - 1, max(-1, target - 257), -1) if ends[i % len(filler)]),
                         target))
    ids, starts, done = list(intro), [0.0] * len(needles), 0
    for i in sorted(range(len(needles)), key=lambda i: cuts[i]):
        ids += hay[done:cuts[i]]
        starts[i] = len(ids) / length
        ids += texts[i]
        done = cuts[i]
    return ids + hay[done:] + question_ids, starts


def passkey_cases(tokenizer, split: str, lengths, depths, trials: int, free: int) -> list[Case]:
    if not (lengths and depths and trials):
        return []
    name, text = passkey_filler(split, tokenizer)
    filler = tokenizer(text)["input_ids"]
    ends = sentence_ends(tokenizer, filler)
    keys = passkeys(split)
    cases = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                key = next(keys)
                ids, actual = passkey_prompt(tokenizer, filler, length, depth, key, ends)
                job = Job(f"passkey:{name}", ids, [], free=free, answer=key, kind="passkey", split=split)
                cases.append(Case("passkey", split, length, depth, f"trial{trial}", job, actual))
    return cases


def two_question_cases(tokenizer, split: str, lengths, pairs) -> list[Case]:
    """A pass key and a door code at the depths of each pair, both asked for at the end."""
    if not (lengths and pairs):
        return []
    name, text = passkey_filler(split, tokenizer)
    filler = tokenizer(text)["input_ids"]
    ends = sentence_ends(tokenizer, filler)
    codes = passkeys(split, TWO_QUESTION_KEYS)
    cases = []
    for length in lengths:
        for first, second in pairs:
            keys = [next(codes) for _ in range(2)]
            needles = [(first, PASSKEY_NEEDLE.format(key=keys[0])), (second, SECOND_NEEDLE.format(key=keys[1]))]
            ids, actual = needle_prompt(tokenizer, filler, length, needles, TWO_QUESTIONS, ends)
            job = Job(f"two-question:{name}", ids, [], free=TWO_QUESTION_FREE, answer=" ".join(keys),
                      kind="passkey", split=split)
            cases.append(Case("two-question", split, length, (first, second), f"{first:g}+{second:g}", job,
                              tuple(actual)))
    return cases


def continuation_cases(tokenizer, split: str, doc_lengths, forced: int, num_docs: int) -> list[Case]:
    if not doc_lengths or num_docs == 0:
        return []
    cases = []
    for src in split_sources(tokenizer, split, num_docs, max(doc_lengths) + forced):
        ids = tokenizer(src.text)["input_ids"]
        for length in doc_lengths:
            job = Job(f"text:{src.name}", ids[:length], ids[length:length + forced], kind=src.kind, split=split)
            cases.append(Case("continuation", split, length, None, src.name, job))
    return cases


def build_cases(tokenizer, args: argparse.Namespace) -> list[Case]:
    return (passkey_cases(tokenizer, args.split, args.lengths, args.depths, args.trials, args.free_tokens)
            + two_question_cases(tokenizer, args.split, args.two_question_lengths, args.two_question_depths)
            + continuation_cases(tokenizer, args.split, args.doc_lengths, args.forced_tokens, args.num_docs))
