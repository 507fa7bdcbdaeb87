"""Prompt log-probabilities from the prefill: against the teacher-forced decode path (prompt[:1]
with forced_token_ids = prompt[1:]) and the model's own non-paged forward, over chunk boundaries,
one-token chunks, n > 1, the prefix cache and mixed batches, without new compiled programs."""

from __future__ import annotations

import numpy as np
import pytest
from test_steady_state import count_compiles

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.logits import model_logits

TOL = 1e-4
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
LONG = [(7 * i) % 300 + 3 for i in range(70)]  # chunks of 32, 32 and 6 tokens
ONE_TOKEN_TAIL = LONG[:65]  # chunks of 32, 32 and 1: the last position goes down the decode path
SHORT = [5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), **OPTIONS)


def asking(top_n: int, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 1, "prompt_logprobs": top_n, **kwargs})


def teacher_forced(llm: LLM, prompt: list[int], top_n: int) -> list[dict]:
    """Entries 1.. from the decode path: one forced prompt token per step after prompt[:1]."""
    params = SamplingParams(temperature=0, max_tokens=len(prompt) - 1, forced_token_ids=prompt[1:], logprobs=top_n,
                            ignore_eos=True)
    out = llm.generate([prompt[:1]], params, use_tqdm=False)[0]
    assert out["token_ids"] == prompt[1:]
    return out["logprobs"]


def assert_matches(entries: list[dict | None], prompt: list[int], expected: list[dict], top_n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    assert [e["token_id"] for e in entries[1:]] == prompt[1:]
    np.testing.assert_allclose([e["logprob"] for e in entries[1:]], [e["logprob"] for e in expected], atol=TOL)
    for ours, theirs in zip(entries[1:], expected):
        assert len(ours["top"]) == top_n
        assert [t for t, _ in ours["top"]] == [t for t, _ in theirs["top"]]
        np.testing.assert_allclose([v for _, v in ours["top"]], [v for _, v in theirs["top"]], atol=TOL)


@pytest.mark.parametrize("top_n", [0, 5])
@pytest.mark.parametrize("prompt", [SHORT, LONG, ONE_TOKEN_TAIL], ids=["short", "three-chunks", "one-token-tail"])
def test_prompt_logprobs_equal_the_teacher_forced_path(llm, prompt, top_n):
    out = llm.generate([prompt], asking(top_n), use_tqdm=False)[0]
    assert_matches(out["prompt_logprobs"], prompt, teacher_forced(llm, prompt, top_n), top_n)


def test_prompt_logprobs_equal_log_softmax_of_the_models_own_forward(llm):
    logits = model_logits(llm.engine.core.loaded.model, SHORT).astype(np.float64)  # [T, V], plain causal attention
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    entries = llm.generate([SHORT], asking(3), use_tqdm=False)[0]["prompt_logprobs"]
    np.testing.assert_allclose([e["logprob"] for e in entries[1:]], logp[np.arange(len(SHORT) - 1), SHORT[1:]],
                               atol=TOL)
    for e, row in zip(entries[1:], logp):
        assert [t for t, _ in e["top"]] == list(np.argsort(-row)[:3])


def test_a_one_token_chunk_with_a_target_and_the_request_batched_with_it(llm, monkeypatch):
    """A 31-token prompt admitted first leaves the asking request one token of the step: its first
    chunk is position 0 alone, on the decode path, predicting prompt[1]. The ordinary request's
    tokens are those it gets alone."""
    ordinary = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    other = LONG[5:36]  # not in the prefix cache yet: its first chunk takes 31 tokens
    chunks = []
    dispatch = llm.engine.core.runner.dispatch
    monkeypatch.setattr(llm.engine.core.runner, "dispatch", lambda scheduled: (
        chunks.extend((c.seq.params.prompt_logprobs, c.start, c.num_tokens) for c in scheduled.chunks),
        dispatch(scheduled))[1])
    both = llm.generate([other, LONG], [ordinary, asking(5)], use_tqdm=False)
    assert (None, 0, 31) in chunks and (5, 0, 1) in chunks and (5, 1, 31) in chunks
    monkeypatch.undo()
    assert both[0]["token_ids"] == llm.generate([other], ordinary, use_tqdm=False)[0]["token_ids"]
    assert_matches(both[1]["prompt_logprobs"], LONG, teacher_forced(llm, LONG, 5), 5)
    assert both[0]["prompt_logprobs"] is None


def test_n_completions_share_the_prompt_logprobs(llm):
    params = asking(5, n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    out = llm.generate([LONG], params, use_tqdm=False)[0]
    assert len(out["outputs"]) == 3
    assert_matches(out["prompt_logprobs"], LONG, teacher_forced(llm, LONG, 5), 5)
    # the first completion computed them (no cache hit); the others share its cached prompt blocks
    assert [o["metrics"]["cached_prompt_tokens"] for o in out["outputs"]] == [0, 64, 64]


def test_a_repeated_request_takes_no_prefix_cache_hit_and_gets_the_same_values(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    assert llm.engine.config.enable_prefix_caching
    first, second = (llm.generate([LONG], asking(5), use_tqdm=False)[0] for _ in range(2))
    assert first["metrics"]["cached_prompt_tokens"] == second["metrics"]["cached_prompt_tokens"] == 0
    assert second["prompt_logprobs"] == first["prompt_logprobs"]
    # its blocks are cached for the requests that do not ask
    plain = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain["metrics"]["cached_prompt_tokens"] == 64 and plain["prompt_logprobs"] is None


def test_streamed_prompt_logprobs_come_with_the_first_token_and_at_the_end(llm):
    outputs = list(llm.stream([LONG], asking(2, max_tokens=5, ignore_eos=True)))
    first, final = outputs[0], outputs[-1]
    assert first.outputs[0].delta_token_ids and len(first.prompt_logprobs) == len(LONG)
    assert all(o.prompt_logprobs is None for o in outputs[1:-1]) and len(outputs) > 2
    assert final.finished and final.prompt_logprobs == first.prompt_logprobs


def test_prompt_logprobs_compile_no_program_once_the_shapes_are_warm(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([LONG, SHORT], plain, use_tqdm=False)  # one 32-token prefill row a step, decode rows 1 and 2
    programs = llm.engine.core.runner.num_compiles
    logged, _ = count_compiles(lambda: llm.generate([LONG, SHORT], [asking(5), asking(0, max_tokens=3)],
                                                    use_tqdm=False))
    assert logged == 0 and llm.engine.core.runner.num_compiles == programs
    # positive control: three sequences decoding together are a new bucket (4 decode rows); the
    # engine's counter sees it even when this process compiled the same program for another engine
    llm.generate([SHORT, SHORT[:5], SHORT[:7]], asking(1, max_tokens=4), use_tqdm=False)
    assert llm.engine.core.runner.num_compiles > programs


def test_under_compression_the_values_before_the_first_compaction_are_the_full_kv_ones(llm):
    # a 32-token budget holds 2 blocks and one 32-token chunk: positions 0..63 see every token
    full = llm.generate([LONG], asking(0, kv_budget=0), use_tqdm=False)[0]["prompt_logprobs"]
    kept = llm.generate([LONG], asking(0, kv_budget=32), use_tqdm=False)[0]
    entries = kept["prompt_logprobs"]
    assert kept["metrics"]["num_compressions"] >= 1
    np.testing.assert_allclose([e["logprob"] for e in entries[1:65]], [e["logprob"] for e in full[1:65]], atol=TOL)
    assert np.max(np.abs([a["logprob"] - b["logprob"] for a, b in zip(entries[65:], full[65:])])) > TOL


def test_a_request_preempted_in_its_prefill_recomputes_the_same_values(llm, llama_dir):
    """A pool of 7 blocks for a growing request and a 7-block prompt: the prompt is preempted (by
    recompute) part way, and computes its prompt log-probabilities again from the start."""
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), asking(5)]
    want = llm.generate([SHORT, prompt], params, use_tqdm=False)
    tiny = LLM(str(llama_dir), **{**OPTIONS, "num_kvcache_blocks": 8})
    got = tiny.generate([SHORT, prompt], params, use_tqdm=False)
    assert got[1]["metrics"]["num_preemptions"] > 0
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    assert_matches(got[1]["prompt_logprobs"], prompt, want[1]["prompt_logprobs"][1:], 5)
