"""eval quality's jobs: the workloads of each split, as sequences to force (forcing.Job).

  texts      the first --length tokens of each text (datasets: dev texts, held-out rule), then
             AGREEMENT_TOKENS greedy tokens
  passkeys   (dev only) a key stated early in a filler, asked for at the end, answered greedily
  reasoning  multi-turn conversations of word problems, the answers written by the model itself
             with full KV (generate_conversations), cached on disk by every input; scored on the
             answer tokens only
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

from zipage_jax.evals.datasets import (
    CONVERSATIONS,
    HELDOUT_MIN_TOKENS,
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    Source,
    dev_sources,
    file_source,
    heldout_sources,
    passkeys,
)
from zipage_jax.evals.forcing import Job, make_llm

PROMPT_TOKENS = 16  # tokens prefilled before forcing starts
AGREEMENT_TOKENS = 32
PASSKEY_QUESTION = "What is the pass key? The pass key is"
REASONING_LENGTH = 3072  # tokens per conversation: the target workload is long reasoning
REASONING_SUFFIX = " Think step by step, then give the answer."
REASONING_ANSWER_TOKENS = 512  # at most per answer
REASONING_MIN_ROOM = 32  # a question is asked (and answered freely) only when its prompt leaves this many tokens
REASONING_SEED_STRIDE = 1000  # turn t of the conversation seeded s samples with seed s * 1000 + t


def text_jobs(tokenizer, sources: list[Source], length: int, split: str = "dev") -> list[Job]:
    jobs = []
    for src in sources:
        ids = tokenizer(src.text)["input_ids"][:length]
        if len(ids) < 4 * PROMPT_TOKENS:
            raise ValueError(f"{src.name} has only {len(ids)} tokens; need at least {4 * PROMPT_TOKENS}")
        jobs.append(Job(f"text:{src.name}", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=AGREEMENT_TOKENS,
                        kind=src.kind, split=split))
    return jobs


def passkey_jobs(tokenizer, length: int, trials: int) -> list[Job]:
    """A dev key stated after ~10% of the filler, asked for at the end (forced), answered greedily."""
    filler = tokenizer(PASSKEY_FILLER)["input_ids"]
    question = tokenizer(PASSKEY_QUESTION)["input_ids"]
    intro = tokenizer(PASSKEY_INTRO)["input_ids"]
    keys = passkeys("dev")
    jobs = []
    for _ in range(trials):
        key = next(keys)
        needle = tokenizer(PASSKEY_NEEDLE.format(key=key))["input_ids"]
        room = length - len(intro) - len(needle) - len(question)
        reps = max(1, room // len(filler))
        before = max(1, reps // 10)
        ids = intro + filler * before + needle + filler * (reps - before) + question
        jobs.append(Job("passkey", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=6, answer=key, kind="passkey"))
    return jobs


def next_prompt(tokenizer, messages: list[dict], ids: list[int], question: dict, stopped: bool = True) -> list[int]:
    """The prompt of the turn asking `question` after `messages` (user and assistant turns, the last an
    answer): `ids`, the conversation's tokens so far (the answers' as the model wrote them, never
    re-tokenized), plus the chat template's tokens between that answer and the next one. stopped: the
    last answer ended with the model's own end-of-turn token (then not repeated)."""
    from zipage_jax.chat import chat_prompt_ids, chat_prompt_text

    if not messages:
        return chat_prompt_ids(tokenizer, [question])
    before = chat_prompt_text(tokenizer, messages[:-1]) + messages[-1]["content"]
    after = chat_prompt_text(tokenizer, [*messages, question])
    if not after.startswith(before):
        raise ValueError("the chat template rewrites earlier turns; a conversation cannot be forced back as written")
    turn = tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]
    if stopped and ids and turn and ids[-1] == turn[0]:  # the end-of-turn token the model wrote itself
        turn = turn[1:]
    return ids + turn


def generate_conversations(llm, length: int, conversations: tuple) -> list[dict]:
    """{"ids", "mask"} of each (problems, seed) in `conversations`, exactly `length` tokens; mask: the
    model's answer tokens. One `llm.generate` call per turn, every conversation still running batched.

    Turn t of the conversation seeded s samples with seed 1000 s + t (temperature 0.6, top-p 0.95),
    and its prompt is the conversation's tokens so far plus the chat template's next user turn. A
    question is asked while its prompt leaves >= REASONING_MIN_ROOM tokens of room; the question that
    leaves less is the last: the room it leaves is its answer's start (end of answer suppressed),
    or, where it does not fit, the question is cut."""
    from zipage_jax import SamplingParams

    n = len(conversations)
    messages: list[list[dict]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    mask: list[list[bool]] = [[] for _ in range(n)]
    stopped = [False] * n  # the last answer ended with an end-of-turn token
    running = list(range(n))
    turn = 0
    while running:
        prompts, params, asked, last = [], [], [], []
        for k in running:
            problems, seed = conversations[k]
            question = {"role": "user", "content": problems[turn % len(problems)] + REASONING_SUFFIX}
            prompt = next_prompt(llm.tokenizer, messages[k], ids[k], question, stopped[k])
            room = length - len(prompt)
            if turn == 0 and room < REASONING_MIN_ROOM:
                raise ValueError(f"a reasoning length of {length} tokens leaves {room} for the first answer "
                                 f"(the first question takes {len(prompt)}); need at least {REASONING_MIN_ROOM}")
            if room <= 0:  # the question itself fills the conversation: unscored
                mask[k] += [False] * (length - len(ids[k]))
                ids[k] = prompt[:length]
                last.append(k)
                continue
            final = room < REASONING_MIN_ROOM  # the last question: the room left is its answer's start
            tokens = room if final else min(room, REASONING_ANSWER_TOKENS)
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.6, top_p=0.95, seed=seed * REASONING_SEED_STRIDE + turn,
                                         max_tokens=tokens, min_tokens=tokens if final else 0, kv_budget=0))
            asked.append((k, question, final))
        outs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for (k, question, final), prompt, out in zip(asked, prompts, outs, strict=True):
            answer = list(out["token_ids"])
            mask[k] += [False] * (len(prompt) - len(ids[k])) + [True] * len(answer)
            ids[k] = prompt + answer
            messages[k] += [question, {"role": "assistant", "content": out["text"]}]
            stopped[k] = out["finish_reason"] == "stop"
            if final or len(ids[k]) >= length:
                last.append(k)
        running = [k for k in running if k not in last]
        turn += 1
    for k in range(n):
        if len(ids[k]) != length:
            raise RuntimeError(f"conversation {k} has {len(ids[k])} tokens, not {length}")
    return [{"ids": i, "mask": m} for i, m in zip(ids, mask, strict=True)]


def reasoning_jobs(llm, length: int, conversations: tuple, split: str = "dev") -> list[Job]:
    """One job per (problems, seed) of `conversations` (a split's), `length` tokens each, scored on
    the answer tokens (generate_conversations); cached on disk by every input."""
    from zipage_jax.models.param_cache import default_cache_dir

    problems_by_seed = [[seed, list(problems)] for problems, seed in conversations]
    inputs = [llm.engine.introspect().model_source, length, problems_by_seed,
              REASONING_SUFFIX, REASONING_ANSWER_TOKENS, REASONING_MIN_ROOM, REASONING_SEED_STRIDE, 0.6, 0.95]
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    cache = default_cache_dir() / f"reasoning-{key}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
    else:
        data = generate_conversations(llm, length, conversations)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(data))
    return [Job(f"reasoning:{split}:seed{seed}", d["ids"][:PROMPT_TOKENS], d["ids"][PROMPT_TOKENS:],
                scored=np.array(d["mask"][PROMPT_TOKENS:], bool), kind="reasoning", split=split)
            for d, (_, seed) in zip(data, conversations, strict=True)]


def build_jobs(loaded, args: argparse.Namespace) -> list[Job]:
    """The jobs of the splits asked for, dev first: texts, passkeys, then the conversations."""
    tok = loaded.tokenizer
    if args.text:
        return text_jobs(tok, [file_source(Path(f), "file") for f in args.text], args.length)
    splits = {"dev": ("dev",), "heldout": ("heldout",), "both": ("dev", "heldout")}[args.split]
    generator = None
    jobs: list[Job] = []
    for split in splits:
        if args.texts:
            sources = (dev_sources(args.num_texts) if split == "dev"
                       else heldout_sources(tok, args.heldout_per_kind, max(HELDOUT_MIN_TOKENS, args.length)))
            jobs += text_jobs(tok, sources, args.length, split=split)
        if split == "dev":
            jobs += passkey_jobs(tok, args.length, args.passkey_trials)
        if args.reasoning:
            if generator is None:  # one engine for every conversation of a split at once
                most = max(len(c) for c in CONVERSATIONS.values())
                blocks = most * (2 + -(-args.reasoning_length // args.block_size)) + 2
                generator = make_llm(loaded, args, blocks, most)
            jobs += reasoning_jobs(generator, args.reasoning_length, CONVERSATIONS[split], split)
    return jobs


def workload_lengths(args: argparse.Namespace) -> dict[str, int]:
    """The nominal context of each workload the run has."""
    lengths = {}
    if args.texts or args.text:
        lengths["text"] = args.length
    if args.reasoning and not args.text:
        lengths["reasoning"] = args.reasoning_length
    if args.passkey_trials and not args.text:
        lengths["passkey"] = args.length
    return lengths
