"""`zipage-jax eval long-prompt` plumbing: passkey prompts and scoring with fake outputs, and --smoke
end to end on a tiny random model."""

import json

import numpy as np
import pytest

from zipage_jax.cli import main as cli
from zipage_jax.evals import datasets, long_prompt
from zipage_jax.evals import long_prompt_cases as cases
from zipage_jax.evals import long_prompt_report as report
from zipage_jax.evals.forcing import Job, JobResult


class _CharTokenizer:
    """One token per character (ids are code points), so prompt lengths and depths are exact."""

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _outcome(text="", logprobs=(), peak=8, compressions=0):
    return cases.Outcome(JobResult(np.array(logprobs, float), [], text),
                       {"kv_blocks_peak": peak, "num_compressions": compressions})


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_passkey_prompt_has_the_length_and_the_key_at_its_depth(depth):
    tok = _CharTokenizer()
    filler = tok("The grass is green. The sky is blue. ")["input_ids"]
    ids, actual = cases.passkey_prompt(tok, filler, 3000, depth, "12345")
    text = tok.decode(ids)
    assert len(ids) == 3000 and text.startswith(datasets.PASSKEY_INTRO) and text.endswith(cases.QUESTION)
    assert text.count("12345") == 2
    at = text.index(datasets.PASSKEY_NEEDLE.format(key="12345"))
    assert actual == at / 3000
    assert abs(at / 3000 - depth) < 0.03  # a sentence end at most 37 characters before the depth
    assert at == len(datasets.PASSKEY_INTRO) or text[at - 1] in ". \n"  # after a sentence, never inside a word


def test_passkey_cases_differ_between_splits(monkeypatch):
    tok = _CharTokenizer()
    monkeypatch.setattr(cases, "passkey_filler", lambda split, t: (split, f"Filler of {split}. "))
    dev = cases.passkey_cases(tok, "dev", [400, 600], [0.1, 0.9], 2, free=5)
    held = cases.passkey_cases(tok, "heldout", [400, 600], [0.1, 0.9], 2, free=5)
    assert [(c.length, c.depth, c.name) for c in dev] == [(n, d, f"trial{k}") for n in (400, 600)
                                                          for d in (0.1, 0.9) for k in range(2)]
    assert all(len(c.job.prompt) == c.length and not c.job.forced and c.job.free == 5 for c in dev + held)
    assert {c.job.answer for c in dev}.isdisjoint({c.job.answer for c in held})  # other seeds
    assert all(len(c.job.answer) == 5 and c.job.answer in tok.decode(c.job.prompt) for c in dev + held)
    assert "Filler of heldout" in tok.decode(held[0].job.prompt) and held[0].split == "heldout"


def test_passkey_scoring_relative_to_full_kv():
    jobs = [Job("passkey", [1], [], free=6, answer=k, kind="passkey") for k in ("11111", "22222", "33333")]
    full = [_outcome(" 11111."), _outcome(" 22222. Remember"), _outcome(" 9")]  # full KV misses the third
    mine = [_outcome(" 11111", peak=12, compressions=3), _outcome(" 2222", peak=13, compressions=4),
            _outcome("key is 33333", peak=12, compressions=3)]
    row = report.passkey_row(mine, full, jobs)
    assert (row["accuracy"], row["correct"], row["full_correct"], row["both_correct"]) == (2 / 3, 2, 2, 1)
    assert row["relative_accuracy"] == 0.5  # of the two full KV gets right, one
    assert report.passkey_row(mine, [_outcome("no")] * 3, jobs)["relative_accuracy"] is None
    peaks = report.peak_fields(mine, [_outcome(peak=126)] * 3)
    assert (peaks["kv_blocks_peak"], peaks["kv_blocks_peak_full"], peaks["num_compressions_max"]) == (13, 126, 4)
    assert peaks["num_compressions_mean"] == pytest.approx(10 / 3)


def test_continuation_ratio_is_full_over_compressed_perplexity():
    jobs = [Job("text:a", [1], [2, 3], kind="code"), Job("text:b", [1], [4, 5], kind="prose")]
    full = [_outcome(logprobs=np.log([0.5, 0.5])), _outcome(logprobs=np.log([0.5, 0.5]))]
    mine = [_outcome(logprobs=np.log([0.25, 0.5])), _outcome(logprobs=np.log([0.5, 0.5]))]
    row = report.continuation_row("streaming", mine, full, jobs)
    assert row["ppl_ratio"] == pytest.approx(0.5 ** (1 / 4))  # pooled: exp(-(log 2) / 4 tokens)
    assert row["ppl_full"] == pytest.approx(2.0) and row["forced_tokens"] == 4 and row["docs"] == ["a", "b"]


def test_arguments(eval_args):
    def parse(*argv):
        return long_prompt.resolve_arguments(eval_args("long-prompt", *argv))

    args = parse()
    assert (args.split, args.policies, args.budgets, args.lengths, args.trials, args.chunk, args.modes) == (
        "heldout", ["vnorm-prompt"], [512], [4000, 8000], 1, 512, ["bounded", "deferred", "chunk-queries"])
    dev = parse("--split", "dev")
    assert len(args.depths) == len(dev.depths) == 10 and set(args.depths).isdisjoint(dev.depths)
    assert args.two_question_depths != dev.two_question_depths and args.timing_reps == 3
    assert report.blocks_bound(512, args) == 16 + 16 + 1  # the budget, one chunk and the tail's block
    quick = parse("--quick", "--split", "dev")
    assert quick.lengths == [4000] and quick.trials == 1 and quick.budgets == [512] and quick.split == "dev"
    assert quick.two_question_lengths == [] and quick.timing_reps == 0
    assert parse("--doc-lengths").doc_lengths == []
    for bad in (["--budgets", "8"], ["--depths", "1.5"], ["--quick", "--smoke"], ["--policies", "full"],
                ["--trials", "0", "--num-docs", "0"], ["--modes", "lazy"], ["--timing-reps", "-1"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_smoke_end_to_end(tiny_model_factory, model_cache_dir, monkeypatch, capsys):
    """Full KV and streaming (bounded) at 64 tokens on 320-token passkey and two-question prompts
    and a 128-token dev text prefilled in chunks of 64: rows, metrics, prefill timing, the tables
    and the JSON line."""
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    model = str(tiny_model_factory("llama"))
    assert cli(["eval", "long-prompt", "--model", model, "--smoke", "--split", "dev", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    rows, workloads = data["results"], data["workloads"]
    tasks = ("passkey", "two-question", "continuation")
    got = {(r["task"], r["policy"], r["budget_tokens"], r["mode"]): r for r in rows}
    assert set(got) == {(t, *p) for t in tasks for p in (("full", 0, "full"), ("streaming", 64, "bounded"))}
    for task in tasks:
        full, mine = got[task, "full", 0, "full"], got[task, "streaming", 64, "bounded"]
        assert full["num_compressions_max"] == 0 and mine["num_compressions_max"] >= 1
        assert full["kv_blocks_peak"] == full["kv_blocks_peak_full"] >= 8  # 128+ tokens in blocks of 16
        assert mine["kv_blocks_peak"] <= mine["kv_blocks_bound"] == 4 + 4 + 2  # budget, chunk, tail
    assert got["continuation", "full", 0, "full"]["ppl_ratio"] == 1.0
    assert 0 < got["continuation", "streaming", 64, "bounded"]["ppl_ratio"] != 1.0
    assert got["passkey", "streaming", 64, "bounded"]["depth"] == 0.5
    assert got["two-question", "full", 0, "full"]["keys"] == 2 * got["two-question", "full", 0, "full"]["requests"]
    assert [(c["task"], c["prompt_tokens"], c["forced_tokens"]) for c in workloads["cases"]] == [
        ("passkey", 320, 0), *[("two-question", 320, 0)] * 4, ("continuation", 128, 16)]
    assert len(data["results"]) == 12 and "commit" in data["run"] and data["timings"]["total"] > 0
    assert [(p["mode"], p["length"]) for p in data["prefill"]] == [("full", 320), ("bounded", 320)]
    assert data["prefill"][0]["ratio_to_full"] == 1.0 and len(data["prefill"][1]["seconds"]) == 1
    assert any(line.startswith("| dev | streaming | bounded | 64 | 320 |") for line in out)
    assert any(line.startswith("| dev | streaming | bounded | 64 | 128 |") for line in out)


def test_heldout_filler_is_a_license_without_digits():
    name, text = datasets.passkey_filler("heldout", _CharTokenizer())
    assert name in {n for n, _ in datasets.heldout_candidates()["license"]} and name not in datasets.DEV_TEXTS
    assert len(text) >= 1024 and not any(c.isdigit() for c in text)
    assert datasets.passkey_filler("dev", _CharTokenizer())[1] == datasets.PASSKEY_FILLER
