"""`zipage-jax eval quality` and `zipage-jax bench plot` plumbing, on a tiny random model."""

import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax import SamplingParams
from zipage_jax.bench import plot as plot_results
from zipage_jax.cli import main as cli
from zipage_jax.evals import datasets, forcing, quality, quality_report, scoring, variants
from zipage_jax.evals import quality_budgets as qb
from zipage_jax.evals import quality_jobs as qj
from zipage_jax.models.loading import load_model

LENGTH = 160  # prompt + forced tokens per job: 10 blocks of 16


@pytest.fixture(scope="module")
def loaded(tiny_model_factory, model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield load_model(str(tiny_model_factory("llama")))
    mp.undo()


@pytest.fixture(scope="module")
def parse(eval_args):
    """The arguments of `zipage-jax eval quality ARGV`, resolved as run() resolves them."""
    return lambda argv: quality.resolve_arguments(eval_args("quality", *argv))


@pytest.fixture(scope="module")
def args(parse):
    return parse(["--length", str(LENGTH), "--block-size", "16", "--query-cache-len", "4", "--no-reasoning"])


def _jobs(free: int = 0) -> list[forcing.Job]:
    rng = np.random.default_rng(0)
    return [forcing.Job("text:t", rng.integers(3, 320, 16).tolist(), rng.integers(3, 320, LENGTH - 16).tolist(),
                        free=free)
            for _ in range(2)]


def test_forced_logprobs_are_the_engines_own(loaded, args):
    """Forcing the tokens greedy decoding chose gives back greedy decoding's log-probabilities."""
    llm = forcing.make_llm(loaded, args, 64, 4)
    prompt = _jobs()[0].prompt
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0,
                                                  kv_budget=0), use_tqdm=False)[0]
    job = forcing.Job("text:t", prompt, plain["token_ids"][:30], free=10)
    (res,) = forcing.teacher_force(llm, [job], [0], ["full"])
    expected = [d["logprob"] for d in plain["logprobs"]]
    np.testing.assert_allclose(res.logprobs, expected[:30], rtol=0, atol=1e-5)
    assert res.generated == plain["token_ids"][30:40]


def test_compression_changes_only_tokens_after_the_first_compaction(loaded, args):
    jobs = _jobs(free=8)
    budget = 64  # 4 blocks: the first compaction comes when the 6th block is needed (token 80)
    llm = forcing.make_llm(loaded, args, forcing.pool_blocks(jobs * 3, [0, 0, budget, budget, budget, budget], 16), 6)
    results = forcing.teacher_force(llm, jobs * 3, [0, 0, budget, budget, budget, budget],
                               ["full", "full", "zipage-attn", "zipage-attn", "streaming", "streaming"])
    full, attn, streaming = results[:2], results[2:4], results[4:]
    before = 5 * 16 - 16  # forced tokens decoded before any compaction (the prompt is 16 tokens)
    for ref, mine in zip(full * 2, attn + streaming, strict=True):
        assert np.all(np.isfinite(mine.logprobs)) and np.all(mine.logprobs <= 0)
        np.testing.assert_allclose(mine.logprobs[:before], ref.logprobs[:before], rtol=0, atol=1e-5)
        assert np.abs(mine.logprobs[before:] - ref.logprobs[before:]).max() > 1e-4
    assert any(not np.allclose(a.logprobs, s.logprobs) for a, s in zip(attn, streaming, strict=True))
    row = scoring.summarise("streaming", 0.4, jobs, streaming, full)
    assert 0 < row["ppl_ratio"] != 1.0 and 0 <= row["agreement"] <= 1 and row["passkey_accuracy"] is None


def test_each_policy_runs_with_its_own_engine_options(loaded, args):
    """Mixed in one batch, every policy gives what an engine built for it alone gives."""
    jobs = _jobs()
    budget = 64
    names = ["zipage-attn", "zipage", "window-attn", "window"]
    mixed, _ = forcing.run_batch(loaded, args, jobs * 4, [budget] * 8, [n for n in names for _ in jobs])
    for k, name in enumerate(names):
        options = dict(variants.VARIANTS[name])
        llm = forcing.make_llm(loaded, args, forcing.pool_blocks(jobs, [budget] * 2, 16), 2,
                          tuple(sorted(options.items())))  # eviction_policy as an engine option
        alone = forcing.teacher_force(llm, jobs, [budget] * 2, ["full"] * 2)  # "full" sets no per-request policy
        for a, b in zip(mixed[2 * k:2 * k + 2], alone, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)  # batch-size rounding
    assert np.abs(mixed[0].logprobs - mixed[2].logprobs).max() > 1e-2  # zipage-attn != zipage
    assert np.abs(mixed[4].logprobs - mixed[6].logprobs).max() > 1e-2  # window-attn != window (global score)


def test_summarise_ratio_and_agreement():
    job = forcing.Job("text:t", [1], [5, 6, 7], free=2)
    full = forcing.JobResult(np.log([0.5, 0.5, 0.5]), [1, 2])
    mine = forcing.JobResult(np.log([0.25, 0.5, 0.5]), [1, 3])
    key = forcing.Job("passkey", [1], [2], free=3, answer="12345", kind="passkey")
    rows = scoring.summarise("p", 0.125, [job, key], [mine, forcing.JobResult(np.zeros(1), [], " 12345.")],
                        [full, forcing.JobResult(np.zeros(1), [], "")])
    assert rows["ppl_ratio"] == pytest.approx(0.5 ** (1 / 3))  # exp(-(log 2) / 3 tokens)
    assert rows["agreement"] == 0.5 and rows["passkey_accuracy"] == 1.0


def test_passkey_jobs_state_the_key_early_and_ask_at_the_end(loaded):
    tok = loaded.tokenizer
    (job,) = qj.passkey_jobs(tok, 3000, 1)
    text = tok.decode(job.prompt + job.forced)
    assert text.rstrip().endswith("The pass key is") and text.index(job.answer) < len(text) // 4
    assert abs(len(job.prompt) + len(job.forced) - 3000) < 60


def test_budget_tokens_and_bad_arguments(parse):
    assert qb.budget_tokens(1 / 8, 2048, 32, 16) == 256
    assert qb.budget_tokens(1 / 16, 1000, 32, 16) == 64
    with pytest.raises(ValueError, match="too small"):
        qb.budget_tokens(1 / 64, 512, 16, 16)
    with pytest.raises(SystemExit):
        parse(["--budgets", "1.5"])
    with pytest.raises(SystemExit):
        parse(["--text", "/no/such/file"])


def _error(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        parse(argv)
    return capsys.readouterr().err


def test_workload_options_and_lengths(parse, capsys):
    default = parse([])
    assert (default.length, default.reasoning_length, default.max_context) == (2048, 3072, 3072)
    assert qj.workload_lengths(default) == {"text": 2048, "reasoning": 3072, "passkey": 2048}
    quick = parse(["--quick"])
    assert qj.workload_lengths(quick) == {"text": 1024, "reasoning": 3072, "passkey": 1024}
    alone = parse(["--reasoning-only", "--budgets", "0.125"])
    assert (alone.texts, alone.passkey_trials, alone.reasoning) == (False, 0, True)
    assert qj.workload_lengths(alone) == {"reasoning": 3072} and alone.max_context == 3072
    assert qj.workload_lengths(parse(["--no-texts", "--no-reasoning"])) == {"passkey": 2048}
    assert qj.workload_lengths(parse(["--no-passkeys", "--no-reasoning"])) == {"text": 2048}
    assert parse(["--passkey-trials", "3", "--split", "heldout"]).passkey_trials == 0  # passkeys: dev only
    assert parse(["--reasoning-length", "1024"]).reasoning_length == 1024  # below 2,000 is allowed
    for argv, message in ((["--reasoning-only", "--no-reasoning"], "nothing to run"),
                          (["--no-texts", "--no-passkeys", "--no-reasoning"], "no workload"),
                          (["--reasoning-length", "32"], "--reasoning-length must be at least 64"),
                          (["--reasoning-only", "--text", __file__], "--text")):
        assert message in _error(parse, argv, capsys)


def test_budgets_that_cannot_hold_the_protected_tokens_are_refused_per_workload(parse, capsys):
    """1/16 of 256 tokens is one block of 16: fewer than the query cache's 16 + 4 protected tokens."""
    short = ["--reasoning-length", "256", "--block-size", "16"]
    assert "reasoning at 256 tokens" in _error(parse, [*short, "--budgets", "0.0625"], capsys)
    assert "too small" in _error(parse, [*short, "--budgets", "0.0625"], capsys)
    assert "too few" in _error(parse, [*short, "--memory-fractions", "0.0625"], capsys)
    assert parse([*short, "--budgets", "0.0625", "--no-reasoning"]).budgets == [0.0625]  # texts: 2048
    assert parse([*short, "--budgets", "0.125"]).budgets == [0.125]  # 32 tokens


def test_plot_writes_png(tmp_path):
    rows = [{"policy": "full", "budget_fraction": 1.0, "ppl_ratio": 1.0, "passkey_accuracy": 1.0, "agreement": 1.0}]
    rows += [{"policy": p, "budget_fraction": f, "ppl_ratio": 0.9 + f / 10, "passkey_accuracy": None,
              "agreement": f} for p in ("streaming", "window") for f in (1 / 8, 1 / 4)]
    src = tmp_path / "q.json"
    src.write_text("log line\n" + json.dumps({"results": rows}) + "\n")
    out = tmp_path / "q.png"
    cli(["bench", "plot", str(src), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_results.plot(rows, out) == ["ppl_ratio", "agreement"]
    cli(["bench", "plot", str(src), "--out", str(out), "--policies", "window"])
    with pytest.raises(ValueError, match="no compressed policy"):
        cli(["bench", "plot", str(src), "--out", str(out), "--policies", "nope"])
    src.write_text("{}\n")
    with pytest.raises(ValueError, match="results"):
        plot_results.load_rows(src)


def test_variants_cover_the_policy_registry(parse):
    from zipage_jax import EngineConfig
    from zipage_jax.compress.policies import POLICIES

    assert set(POLICIES) <= set(variants.VARIANTS)
    for name, options in variants.VARIANTS.items():
        assert options.get("eviction_policy", "zipage") in POLICIES, name
        EngineConfig.from_options(**variants.group_engine_options(variants.engine_group(name), block_size=32,
                                                                  query_cache_len=16, longest=3072))
    assert variants.engine_group("window") == variants.engine_group("vnorm-window") == (("use_global_score", True),)
    assert variants.engine_group("zipage-attn") == ()  # attention only: engine_options turns the global score off


# -- equal memory and the held-out set ---------------------------------------------------------

SMOLLM = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # the default model's KV shape


def test_kv_token_bytes_count_values_and_scales():
    values = 2 * 30 * 3 * 64  # K and V of every layer and kv head
    assert qb.kv_token_bytes(SMOLLM, "auto", jnp.bfloat16) == 2 * values
    assert qb.kv_token_bytes(SMOLLM, "auto", jnp.float32) == 4 * values
    for dtype in ("int8", "fp8"):  # one byte a value plus a float32 scale per token, kv head, K / V, layer
        assert qb.kv_token_bytes(SMOLLM, dtype, jnp.bfloat16) == values + 4 * 2 * 30 * 3


def test_memory_budget_tokens_at_equal_memory():
    bf16, int8 = 2 * 64, 64 + 4  # bytes per value of one token's K (likewise V): the ratio is what counts
    for fraction, tokens_bf16, tokens_int8 in ((1 / 16, 64, 112), (1 / 8, 128, 240), (1 / 4, 256, 480)):
        assert qb.memory_budget_tokens(fraction, 1024, bf16, bf16, 16, 16) == tokens_bf16
        # floor(fraction * 1024 * 128 / 68) tokens, rounded down to blocks of 16: never more memory
        assert qb.memory_budget_tokens(fraction, 1024, int8, bf16, 16, 16) == tokens_int8
        assert tokens_int8 * int8 <= fraction * 1024 * bf16 < (tokens_int8 + 16) * int8
    assert qb.memory_budget_tokens(1 / 8, 1024, int8, bf16, 32, 16) == 224  # 240.9 -> 7 blocks of 32
    with pytest.raises(ValueError, match="too few"):
        qb.memory_budget_tokens(1 / 64, 512, bf16, bf16, 16, 16)


def test_budget_fields_as_tokens_and_as_memory():
    row = qb.budget_fields(SMOLLM, qb.Point("vnorm-window", "int8", "memory", 1 / 8), 1024, 240, jnp.float32)
    assert (row["context"], row["budget_tokens"], row["kept_fraction"]) == (1024, 240, 240 / 1024)
    assert row["memory_fraction_bf16"] == pytest.approx(240 * 68 / (1024 * 128))
    assert row["memory_fraction_f32"] == pytest.approx(240 * 68 / (1024 * 256))
    auto = qb.budget_fields(SMOLLM, qb.Point("streaming", "auto", "tokens", 1 / 8), 3072, 384, jnp.float32)
    assert auto["memory_fraction_bf16"] == auto["memory_fraction_f32"] == auto["kept_fraction"] == 1 / 8
    full = qb.budget_fields(SMOLLM, qb.Point("full", "fp8", "memory", 1.0), 1024, 0, jnp.float32)  # quantization alone
    assert full["budget_tokens"] == 1024 and full["memory_fraction_bf16"] == 68 / 128


def _job(context: int, kind: str = "text", split: str = "dev") -> forcing.Job:
    return forcing.Job(f"{kind}:{context}", [0] * qj.PROMPT_TOKENS, [0] * (context - qj.PROMPT_TOKENS), kind=kind,
                       split=split)


def test_plan_points_of_both_kinds_and_budgets_per_job_length(parse):
    args = parse(["--budgets", "0.125", "--memory-fractions", "0.0625", "0.125",
                          "--kv-cache-dtypes", "auto", "int8", "fp8"])
    assert (args.policies, args.block_size, args.split, args.passkey_trials) == (quality.MEMORY_POLICIES, 16, "both", 0)
    points = qb.plan_points(args)
    assert [p for p in points if p.policy == "full"] == [qb.Point("full", "int8", "memory", 1.0),
                                                         qb.Point("full", "fp8", "memory", 1.0)]
    assert [p for p in points if p.fraction_kind == "tokens"] == [qb.Point(p, "auto", "tokens", 0.125)
                                                                  for p in quality.MEMORY_POLICIES]
    assert len(points) == len(quality.MEMORY_POLICIES) + 2 + 3 * 2 * len(quality.MEMORY_POLICIES)
    jobs = [_job(1024), _job(3072, "reasoning"), _job(1000, "passkey")]
    budgets = qb.point_budgets(points, jobs, SMOLLM, args)
    got = {(p.kv_cache_dtype, p.fraction_kind, p.fraction): b for p, b in budgets.items() if p.policy == "streaming"}
    # tokens: rounded to blocks of 16; memory: floor(f * context * 128 / 68) rounded down to blocks
    assert got == {("auto", "tokens", 0.125): [128, 384, 128], ("auto", "memory", 0.0625): [64, 192, 48],
                   ("auto", "memory", 0.125): [128, 384, 112], ("int8", "memory", 0.0625): [112, 352, 112],
                   ("int8", "memory", 0.125): [240, 720, 224], ("fp8", "memory", 0.0625): [112, 352, 112],
                   ("fp8", "memory", 0.125): [240, 720, 224]}
    assert budgets[qb.Point("full", "int8", "memory", 1.0)] == [0, 0, 0]
    small = parse(["--budgets", "0.0625", "--block-size", "16"])  # 1/16 of 256 tokens: one block
    with pytest.raises(ValueError, match=r"reasoning job reasoning:256 \(256 tokens\).*too small"):
        qb.point_budgets(qb.plan_points(small), [_job(2048), _job(256, "reasoning")], SMOLLM, small)
    for bad in (["--kv-cache-dtypes", "int8"], ["--memory-fractions", "1.0"], ["--heldout-per-kind", "-1"]):
        with pytest.raises(SystemExit):
            parse(bad)
    legacy = parse(["--budgets", "0.125", "--policies", "full", "streaming"])
    assert qb.plan_points(legacy) == [qb.Point("streaming", "auto", "tokens", 0.125)]
    assert qb.fraction_kinds(legacy) == ["tokens"] and qb.fraction_kinds(args) == ["tokens", "memory"]


def test_auto_budgets_are_planned_beside_fractions(parse):
    args = parse(["--budgets", "0.125", "auto", "--policies", "streaming", "vnorm-prompt"])
    assert qb.plan_points(args) == [qb.Point("streaming", "auto", "tokens", 0.125),
                                    qb.Point("vnorm-prompt", "auto", "tokens", 0.125),
                                    qb.Point("streaming", "auto", "auto", 0.0),
                                    qb.Point("vnorm-prompt", "auto", "auto", 0.0)]
    assert qb.fraction_kinds(args) == ["tokens", "auto"]
    full = qb.Point("full", "auto", "auto", 1.0)
    budgets = qb.point_budgets([full, *qb.plan_points(args)], [_job(1024), _job(3072, "reasoning")], SMOLLM, args)
    assert budgets[full] == [0, 0] and budgets[qb.Point("streaming", "auto", "auto", 0.0)] == ["auto", "auto"]
    assert budgets[qb.Point("streaming", "auto", "tokens", 0.125)] == [128, 384]
    job = _job(160)  # an automatic budget may hold the whole job: its pool share is full KV's
    assert forcing.pool_blocks([job], ["auto"], 16) == forcing.pool_blocks([job], [0], 16) == 2 + 10 + 10 + 1
    for bad in (["--budgets", "automatic"], ["--budgets", "auto", "1.5"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_an_automatic_budget_reports_the_peak_it_held(loaded, args, monkeypatch):
    """kv_budget="auto" through teacher forcing: its row's kept tokens are the jobs' mean peak KV as the
    engine reports it, and its memory and table cells follow from that peak."""
    from zipage_jax import harness

    # a loose threshold: every measurement compacts (to the floor), so the budget stays small
    monkeypatch.setattr(forcing, "build_llm", lambda **kw: harness.build_llm(**kw, auto_budget_threshold=0.9))
    jobs = _jobs()
    results, _ = forcing.run_batch(loaded, args, jobs * 2, [0, 0, "auto", "auto"],
                                   ["full", "full", "vnorm-prompt", "vnorm-prompt"])
    full, auto = results[:2], results[2:]
    # full KV holds every token it has written: the prompt and all but the last forced token, in blocks of 16
    assert [r.peak_kv_tokens for r in full] == [-(-(LENGTH - 1) // 16) * 16] * 2
    peaks = [r.peak_kv_tokens for r in auto]
    # the prompt's block kept whole, the floor of 32 tokens, and the block being filled, at least
    assert all(16 + 32 + 16 <= p < LENGTH and p % 16 == 0 for p in peaks)
    point = qb.Point("vnorm-prompt", "auto", "auto", 0.0)
    (row,) = quality_report.point_rows(point, jobs, auto, full, ["auto", "auto"], loaded)
    kept = round(sum(peaks) / 2)
    text = row["by_workload"]["text"]
    assert (text["context"], text["budget_tokens"]) == (LENGTH, kept)
    assert text["kept_fraction"] == row["budget_fraction"] == kept / LENGTH
    assert text["memory_fraction_bf16"] == pytest.approx(kept / LENGTH)
    assert row["fraction_kind"] == "auto" and 0 < row["ppl_ratio"] != 1.0  # it evicted
    (ref,) = quality_report.point_rows(qb.Point("full", "auto", "auto", 1.0), jobs, full, full, [0, 0], loaded)
    assert ref["ppl_ratio"] == 1.0 and ref["budget_tokens"] == LENGTH and ref["budget_fraction"] == 1.0
    table = quality_report.markdown_table([ref, row])
    assert quality_report.TABLE_TITLES["auto"] in table
    assert f"| full | 1 | {LENGTH} | 1.0000 |" in table
    assert f"| vnorm-prompt | auto | {kept} | {kept / LENGTH:.4f} | {row['ppl_ratio']:.3f} |" in table
    assert "auto" in quality_report.format_row(row)


def test_heldout_texts_are_fixed_and_never_dev(loaded):
    first = datasets.heldout_sources(loaded.tokenizer, 1)
    assert [s.kind for s in first] == list(datasets.HELDOUT_KINDS)  # the stdlib alone has a long text of each kind
    again = datasets.heldout_sources(loaded.tokenizer, 1)
    assert [(s.name, s.text) for s in again] == [(s.name, s.text) for s in first]
    assert not {s.name for s in first} & set(datasets.DEV_TEXTS)
    assert all(len(loaded.tokenizer(s.text)["input_ids"]) >= datasets.HELDOUT_MIN_TOKENS for s in first)
    assert not set(datasets.HELDOUT_PROBLEMS) & set(datasets.DEV_PROBLEMS)


# -- reasoning conversations --------------------------------------------------------------------

QUESTIONS = ("Add 2 and 3.", "Name a colour.", "Count to four.")
CONVERSATIONS = ((QUESTIONS, 0), (datasets.rotated(QUESTIONS, 1), 5))
REASONING = 256  # tokens per conversation: three turns of answers of at most 40 tokens on the tiny model


def test_next_prompt_keeps_the_answers_tokens_as_written(loaded):
    from zipage_jax.chat import chat_prompt_ids, chat_prompt_text

    tok = loaded.tokenizer
    q1, q2 = ({"role": "user", "content": q} for q in QUESTIONS[:2])
    first = qj.next_prompt(tok, [], [], q1)
    assert first == chat_prompt_ids(tok, [q1])
    answer = [tok(c, add_special_tokens=False)["input_ids"][0] for c in "the cat"]  # one token a character
    assert answer != tok("the cat", add_special_tokens=False)["input_ids"]  # not how the tokenizer writes it
    messages = [q1, {"role": "assistant", "content": tok.decode(answer)}]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for written, stopped in ((answer + [eos], True), (answer, False)):  # ended by the model, or cut at max_tokens
        ids = first + written
        prompt = qj.next_prompt(tok, messages, ids, q2, stopped)
        assert prompt[:len(ids)] == ids  # the answer as written: never re-tokenized
        assert tok.decode(prompt) == chat_prompt_text(tok, [*messages, q2])  # one end-of-turn, as the template


def test_conversations_batched_per_turn_exact_length_answer_mask_and_cache(loaded, parse, monkeypatch):
    monkeypatch.setattr(qj, "REASONING_ANSWER_TOKENS", 40)
    args = parse(["--reasoning-length", str(REASONING), "--block-size", "16", "--query-cache-len", "4"])
    llm = forcing.make_llm(loaded, args, 2 * (REASONING // 16 + 2) + 2, 2)
    calls, generate = [], llm.generate

    def spy(prompts, params, use_tqdm=False):
        outs = generate(prompts, params, use_tqdm=use_tqdm)
        calls.append((prompts, params, outs))
        return outs

    llm.generate = spy
    jobs = qj.reasoning_jobs(llm, REASONING, CONVERSATIONS, "heldout")
    assert [(j.workload, j.kind, j.split, j.context) for j in jobs] == [
        ("reasoning:heldout:seed0", "reasoning", "heldout", REASONING), ("reasoning:heldout:seed5", "reasoning",
                                                                           "heldout", REASONING)]
    assert len(calls) >= 3 and all(len(prompts) == 2 for prompts, _, _ in calls)  # one call a turn, both batched
    tok = loaded.tokenizer
    for k, (job, (problems, seed)) in enumerate(zip(jobs, CONVERSATIONS, strict=True)):
        ids = job.prompt + job.forced
        mask = np.zeros(REASONING, bool)
        for turn, (prompts, params, outs) in enumerate(calls):
            prompt, answer = prompts[k], outs[k]["token_ids"]
            assert params[k].seed == seed * 1000 + turn and (params[k].temperature, params[k].top_p) == (0.6, 0.95)
            assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(answer)] == answer
            assert tok.decode(prompt).endswith(problems[turn % 3] + qj.REASONING_SUFFIX + "<|im_end|>\n"
                                               "<|im_start|>assistant\n")  # this turn's question
            mask[len(prompt):len(prompt) + len(answer)] = True
        assert calls[-1][1][k].min_tokens == calls[-1][1][k].max_tokens < qj.REASONING_MIN_ROOM  # the last room
        assert not mask[:qj.PROMPT_TOKENS].any()
        np.testing.assert_array_equal(job.scored, mask[qj.PROMPT_TOKENS:])  # the answers' tokens, nothing else
    assert jobs[0].forced != jobs[1].forced

    def refuse(*_, **__):
        raise AssertionError("generated again")

    llm.generate = refuse
    again = qj.reasoning_jobs(llm, REASONING, CONVERSATIONS, "heldout")  # from the disk cache
    assert [(j.prompt, j.forced) for j in again] == [(j.prompt, j.forced) for j in jobs]
    assert all(np.array_equal(a.scored, j.scored) for a, j in zip(again, jobs, strict=True))
    other_seed = (CONVERSATIONS[0], (CONVERSATIONS[1][0], 6))
    for changed in ((REASONING - 16, CONVERSATIONS), (REASONING, other_seed), (REASONING, CONVERSATIONS[:1]),
                    (REASONING, ((QUESTIONS[:2], 0),))):
        with pytest.raises(AssertionError, match="generated again"):  # every input is in the cache key
            qj.reasoning_jobs(llm, *changed)
    with pytest.raises(ValueError, match="first answer"):  # no room for an answer after the first question
        qj.reasoning_jobs(llm, 64, CONVERSATIONS)


def test_both_fraction_kinds_texts_and_reasoning_end_to_end(loaded, parse, tiny_model_factory, monkeypatch):
    """Texts of 160 tokens and conversations of 256 in one run, at a quarter of their tokens and a
    quarter of their bf16 bytes (auto and int8): budgets per job length, one engine per (engine options,
    kv dtype) with every point of it batched, rows per split with each workload's lengths, tables."""
    monkeypatch.setattr(datasets, "HELDOUT_KINDS", ("code",))
    monkeypatch.setattr(qj, "REASONING_ANSWER_TOKENS", 40)
    monkeypatch.setitem(datasets.CONVERSATIONS, "dev", CONVERSATIONS)
    monkeypatch.setitem(datasets.CONVERSATIONS, "heldout", ((datasets.rotated(QUESTIONS, 2), 7),))
    engines, make_llm = [], forcing.make_llm

    def spy(loaded, args, num_blocks, max_num_seqs, group=()):
        engines.append((group, max_num_seqs))
        return make_llm(loaded, args, num_blocks, max_num_seqs, group)

    monkeypatch.setattr(forcing, "make_llm", spy)  # the engines of the forced runs
    monkeypatch.setattr(qj, "make_llm", spy)  # the conversations' engine
    args = parse(["--model", str(tiny_model_factory("llama")), "--budgets", "0.25", "--memory-fractions",
                  "0.25", "--kv-cache-dtypes", "auto", "int8", "--policies", "zipage-attn", "--length",
                  str(LENGTH), "--reasoning-length", str(REASONING), "--num-texts", "1",
                  "--heldout-per-kind", "1", "--query-cache-len", "4"])
    rows, workloads = quality.evaluate(args)
    assert [(j["kind"], j["split"], j["context"]) for j in workloads["jobs"]] == [
        ("code", "dev", LENGTH), ("reasoning", "dev", REASONING), ("reasoning", "dev", REASONING),
        ("code", "heldout", LENGTH), ("reasoning", "heldout", REASONING)]
    assert workloads["lengths"] == {"text": LENGTH, "reasoning": REASONING}
    # the conversations (2 at once), full KV, then per kv dtype one engine: auto's tokens and memory points
    # have equal budgets and run once (5 jobs); int8's full KV and zipage-attn share engine options (10)
    int8 = (("kv_cache_dtype", "int8"),)
    assert engines == [((), 2), ((), 5), ((), 5), (int8, 10)]
    got = {(r["policy"], r["kv_cache_dtype"], r["fraction_kind"], r["split"]): r for r in rows}
    points = [("full", "auto", "tokens"), ("zipage-attn", "auto", "tokens"), ("full", "auto", "memory"),
              ("full", "int8", "memory"), ("zipage-attn", "auto", "memory"), ("zipage-attn", "int8", "memory")]
    assert set(got) == {(*p, s) for p in points for s in ("dev", "heldout")} and len(rows) == len(got)
    # tiny llama: 2 layers, 2 kv heads, head dim 16: bf16 64 bytes a token per layer and head, int8 16 + 4 + 16 + 4
    budgets = {("auto", "tokens"): (32, 64), ("auto", "memory"): (32, 64), ("int8", "memory"): (64, 96)}
    for split in ("dev", "heldout"):
        for kind in ("tokens", "memory"):
            full = got["full", "auto", kind, split]
            assert full["ppl_ratio"] == full["reasoning_ppl_ratio"] == 1.0 and full["budget_fraction"] == 1.0
        quant = got["full", "int8", "memory", split]
        assert 0.9 < quant["ppl_ratio"] < 1.1 and 0.9 < quant["reasoning_ppl_ratio"] < 1.1  # int8 rounding only
        assert quant["by_workload"]["reasoning"]["memory_fraction_bf16"] == pytest.approx(40 / 64)
        for (dtype, kind), (text, reasoning) in budgets.items():
            r = got["zipage-attn", dtype, kind, split]
            assert r["fraction"] == 0.25 and r["split"] == split
            assert {w: (f["context"], f["budget_tokens"]) for w, f in r["by_workload"].items()} == {
                "text": (LENGTH, text), "reasoning": (REASONING, reasoning)}
            for f in r["by_workload"].values():
                assert f["kept_fraction"] == f["budget_tokens"] / f["context"]
                bf16, f32 = (40 / 64, 40 / 128) if dtype == "int8" else (1, 1)  # this CPU stores auto in f32
                assert f["memory_fraction_bf16"] == pytest.approx(f["kept_fraction"] * bf16)
                assert f["memory_fraction_f32"] == pytest.approx(f["kept_fraction"] * f32)
            assert (r["context"], r["budget_tokens"]) == (LENGTH, text)  # flat: the first workload's
            assert 0 < r["ppl_ratio"] != 1.0 and 0 < r["reasoning_ppl_ratio"] != 1.0
            assert set(r["ppl_ratio_by_job"]) == {f"text:{j['name'][5:]}" for j in workloads["jobs"]
                                                  if j["split"] == split and j["kind"] == "code"} | {
                j["name"] for j in workloads["jobs"] if j["split"] == split and j["kind"] == "reasoning"}
        tokens, memory = got["zipage-attn", "auto", "tokens", split], got["zipage-attn", "auto", "memory", split]
        assert tokens["ppl_ratio"] == memory["ppl_ratio"] and tokens["reasoning_ppl_ratio"] == memory[
            "reasoning_ppl_ratio"]  # the same budgets: one run
        assert memory["memory_fraction"] == 0.25 and "memory_fraction" not in tokens
        assert got["zipage-attn", "int8", "memory", split]["reasoning_ppl_ratio"] != memory["reasoning_ppl_ratio"]
    table = quality_report.markdown_table(rows, workloads["lengths"])
    assert table.startswith(f"Context: text {LENGTH} tokens, reasoning {REASONING} tokens.")
    titles = quality_report.TABLE_TITLES
    assert table.count("| policy |") == 2 and titles["tokens"] in table and titles["memory"] in table

    def pair(key, *point):
        return f"{got[(*point, 'heldout')][key]:.3f} ({got[(*point, 'dev')][key]:.3f})"

    bf16 = [kept * 40 / (context * 64) for kept, context in ((64, LENGTH), (96, REASONING))]  # text, reasoning
    assert (f"| zipage-attn | int8 | {bf16[0]:.4f} / {bf16[1]:.4f} | {bf16[0] / 2:.4f} / {bf16[1] / 2:.4f} | 64 / 96 | "
            f"{pair('ppl_ratio', 'zipage-attn', 'int8', 'memory')} | "
            f"{pair('reasoning_ppl_ratio', 'zipage-attn', 'int8', 'memory')} | "
            f"{pair('agreement', 'zipage-attn', 'int8', 'memory')} |") in table
    assert (f"| zipage-attn | 0.25 | 32 / 64 | {32 / LENGTH:.4f} / {64 / REASONING:.4f} | "
            f"{pair('ppl_ratio', 'zipage-attn', 'auto', 'tokens')} | "
            f"{pair('reasoning_ppl_ratio', 'zipage-attn', 'auto', 'tokens')} |") in table
    assert ("| memory of bf16 full KV (text / reasoning) | of f32 (text / reasoning) | kept tokens (text / reasoning) "
            "|") in table


def test_main_prints_the_tables_and_the_json_with_the_lengths(monkeypatch, capsys, tmp_path):
    row = {"policy": "full", "kv_cache_dtype": "auto", "fraction_kind": "tokens", "fraction": 1.0, "split": "dev",
           "budget_fraction": 1.0, "ppl_ratio": 1.0, "reasoning_ppl_ratio": 1.0, "passkey_accuracy": None,
           "agreement": None, "by_workload": {"reasoning": qb.budget_fields(SMOLLM, qb.Point("full", "auto", "tokens",
                                                                                          1.0), 3072, 0, jnp.float32)}}
    workloads = {"lengths": {"reasoning": 3072}, "jobs": []}
    monkeypatch.setattr(quality, "evaluate", lambda args: ([row], workloads))
    assert cli(["eval", "quality", "--reasoning-only", "--json", "--markdown", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert data["results"] == [row] and data["workloads"] == workloads and data["lengths"] == {"reasoning": 3072}
    assert out[0] == "Context: reasoning 3072 tokens."
    assert "| full | 1 | 3072 | 1.0000 | 1.000 | 1.000 |" in (tmp_path / "t.md").read_text()


def test_plot_memory_writes_png(tmp_path):
    rows = [{"policy": "full", "kv_cache_dtype": "auto", "memory_fraction": 1.0, "memory_fraction_bf16": 1.0,
             "budget_fraction": 1.0, "split": s, "ppl_ratio": 1.0, "reasoning_ppl_ratio": 1.0}
            for s in ("dev", "heldout")]
    rows += [{"policy": "full", "kv_cache_dtype": "int8", "memory_fraction": 0.53, "memory_fraction_bf16": 0.53,
              "budget_fraction": 1.0, "split": "heldout", "ppl_ratio": 0.999, "reasoning_ppl_ratio": 0.998}]
    rows += [{"policy": p, "kv_cache_dtype": d, "memory_fraction": f, "memory_fraction_bf16": f * 0.99,
              "budget_fraction": f, "split": s, "ppl_ratio": 0.9 + f / 10, "reasoning_ppl_ratio": 0.8 + f / 10}
             for p in ("streaming", "vnorm-window") for d in ("auto", "int8") for f in (1 / 8, 1 / 4)
             for s in ("dev", "heldout")]
    src = tmp_path / "m.json"
    src.write_text(json.dumps({"results": rows}) + "\n")
    out = tmp_path / "m.png"
    cli(["bench", "plot", str(src), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_results.plot_memory(rows, out) == ["heldout", "dev"]
    assert len(plot_results.merge([src, src])) == len(rows)  # dtype, fraction and split keep rows apart


def test_plot_both_fraction_kinds_and_any_kv_dtype(tmp_path):
    """A run with --budgets and --memory-fractions: the memory plot at --out, the token plot beside it;
    a kv dtype the plot has never heard of still gets its own line style."""
    def row(policy, dtype, kind, f, split):
        r = {"policy": policy, "kv_cache_dtype": dtype, "fraction_kind": kind, "fraction": f, "split": split,
             "budget_fraction": f, "memory_fraction_bf16": f, "ppl_ratio": 0.9 + f / 10,
             "reasoning_ppl_ratio": 0.8 + f / 10, "passkey_accuracy": None, "agreement": None}
        return r | ({"memory_fraction": f} if kind == "memory" else {})

    rows = [row("full", "auto", k, 1.0, s) for k in ("tokens", "memory") for s in ("dev", "heldout")]
    rows += [row("streaming", "auto", "tokens", f, s) for f in (1 / 8, 1 / 4) for s in ("dev", "heldout")]
    rows += [row("streaming", d, "memory", f, s) for d in ("auto", "int8", "int4") for f in (1 / 8, 1 / 4)
             for s in ("dev", "heldout")]
    rows.append(row("full", "int4", "memory", 0.3, "heldout"))
    src = tmp_path / "both.json"
    src.write_text(json.dumps({"results": rows}) + "\n")
    assert len(plot_results.merge([src])) == len(rows)  # the fraction kind keeps equal fractions apart
    assert plot_results.dtype_styles(rows) == {"auto": "-", "int8": "--", "int4": ":"}
    texts_and_talk = rows[-1] | {"by_workload": {"text": {"memory_fraction_bf16": 0.25},
                                                 "reasoning": {"memory_fraction_bf16": 0.2344}}}
    assert plot_results.memory_x(texts_and_talk, "reasoning_ppl_ratio") == 0.2344  # each workload at its memory
    assert plot_results.memory_x(texts_and_talk, "ppl_ratio") == 0.25 and plot_results.memory_x(rows[-1], "x") == 0.3
    out = tmp_path / "both.png"
    cli(["bench", "plot", str(src), "--out", str(out)])
    for path in (out, tmp_path / "both_tokens.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
