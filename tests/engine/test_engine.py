"""The paged full-KV engine on a tiny random Llama: exactness, prefix cache, preemption,
batching, sampling options through the engine, bad inputs, no recompiles."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from zipage_jax import LLM, SamplingParams
from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12],
           [300, 1, 2, 3],
           [7] * 37,
           [200, 201]]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory, model_cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def make_llm(path, **options) -> LLM:
    defaults = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    return LLM(str(path), **{**defaults, **options})


def token_ids(results) -> list[list[int]]:
    return [r["token_ids"] for r in results]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_greedy_matches_transformers(llama_dir, expected):
    model = load_reference_model(str(llama_dir))
    for prompt, ours in zip(PROMPTS, expected):
        assert ours == reference_greedy(model, prompt, 12)


def test_reference_greedy_generates_through_eos(llama_dir, expected):
    # the crosscheck compares against ignore_eos: transformers must not stop at the model's EOS
    model = load_reference_model(str(llama_dir))
    eos = expected[0][1]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    out = reference_greedy(model, PROMPTS[0], 12)
    assert len(out) == 12 and out == expected[0]


def test_batch_composition_does_not_change_greedy_output(llm, expected):
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert alone == expected
    reordered = token_ids(llm.generate(PROMPTS[::-1], GREEDY, use_tqdm=False))
    assert reordered[::-1] == expected


@pytest.mark.parametrize("block_size", [64, 256])
def test_large_blocks_read_as_pages_give_the_same_output(llama_dir, expected, block_size):
    # the XLA path gathers only the 16-token pages of these blocks that the longest row needs
    llm = make_llm(llama_dir, kvcache_block_size=block_size, num_kvcache_blocks=9, attention_backend="xla")
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_chunked_prefill_matches_whole_prefill(llama_dir, expected):
    small = make_llm(llama_dir, max_num_batched_tokens=16)
    assert token_ids(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


def test_prefix_cache_hit_skips_prefill_and_keeps_output(llama_dir):
    llm = make_llm(llama_dir)
    prompt = list(range(10, 10 + 50))  # 3 full blocks of 16
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first["metrics"]["cached_prompt_tokens"] == 0
    assert second["metrics"]["cached_prompt_tokens"] == 48
    assert second["token_ids"] == first["token_ids"]
    nocache = make_llm(llama_dir, enable_prefix_caching=False)
    assert nocache.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == first["token_ids"]


def test_tiny_pool_preempts_and_every_request_matches(llama_dir, expected):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = make_llm(llama_dir)
    want = token_ids(big.generate(PROMPTS, params, use_tqdm=False))
    tiny = make_llm(llama_dir, num_kvcache_blocks=9)  # 8 usable blocks of 16 slots for 4 sequences
    got = tiny.generate(PROMPTS, params, use_tqdm=False)
    assert token_ids(got) == want
    assert tiny.engine.get_stats().num_preemptions > 0
    assert tiny.engine.core.block_manager.num_free_blocks == 8


def test_n_siblings_share_prompt_blocks_and_differ(llama_dir):
    llm = make_llm(llama_dir)
    prompt = list(range(40, 40 + 35))
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["outputs"]) == 3
    assert [o["metrics"]["cached_prompt_tokens"] for o in out["outputs"]] == [0, 32, 32]
    assert len({tuple(o["token_ids"]) for o in out["outputs"]}) > 1
    again = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [o["token_ids"] for o in again["outputs"]] == [o["token_ids"] for o in out["outputs"]]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]["token_ids"]
    batched = llm.generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(temperature=1.0, max_tokens=5), params],
                           use_tqdm=False)[1]["token_ids"]
    assert alone == batched


def test_stop_token_ids_min_tokens_and_max_tokens(llm, expected):
    first = expected[0]
    stop_at = first[4]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == stop_at
    assert out["token_ids"] == first[: first.index(stop_at) + 1]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 12 and stop_at not in out["token_ids"]


def test_eos_stops_past_min_tokens_unless_ignored_and_a_stop_token_s_text_is_dropped(llm):
    # teacher-forced outputs put EOS (2, the tiny tokenizer's <|im_end|>) and a stop id where the
    # test wants them; the engine core finishes the sequence, the output stage cuts the text
    eos, stop_id = 2, 42
    assert llm.engine.core.eos_token_ids == (eos,)
    forced = [40, 41, eos, stop_id, eos, 43]

    def run(**options) -> tuple[dict, str]:
        params = SamplingParams(temperature=0, max_tokens=len(forced), forced_token_ids=forced, **options)
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
        streamed = list(llm.stream([PROMPTS[1]], params))  # the incremental path gives the same text
        assert streamed[-1].finished and streamed[-1].outputs[0].text == out["text"]
        assert "".join(o.outputs[0].delta_text for o in streamed) == out["text"]
        assert [t for o in streamed for t in o.outputs[0].delta_token_ids] == out["token_ids"]
        return out, out["outputs"][0]["stop_reason"]

    def text(ids: list[int], skip: bool = True) -> str:
        return llm.tokenizer.decode(ids, skip_special_tokens=skip)

    out, reason = run()
    assert (out["finish_reason"], reason, out["token_ids"], out["text"]) == ("stop", None, forced[:3], text([40, 41]))
    out, reason = run(ignore_eos=True)
    assert (out["finish_reason"], out["token_ids"]) == ("length", forced)
    out, reason = run(ignore_eos=True, stop_token_ids=[stop_id])
    assert (out["finish_reason"], reason, out["token_ids"]) == ("stop", stop_id, forced[:4])
    assert out["text"] == text([40, 41, eos])
    out, reason = run(min_tokens=3)  # the first EOS is within min_tokens, the second is not
    assert (out["finish_reason"], reason, out["token_ids"]) == ("stop", None, forced[:5])
    out, reason = run(min_tokens=3, stop_token_ids=[stop_id])  # nor is the stop id, the 4th token
    assert (out["finish_reason"], reason, out["token_ids"]) == ("stop", stop_id, forced[:4])
    out, reason = run(skip_special_tokens=False)  # EOS's text is dropped as a stop token's
    assert out["text"] == text([40, 41], skip=False)
    out, reason = run(skip_special_tokens=False, include_stop_str_in_output=True)
    assert out["text"] == text(forced[:3], skip=False) and out["text"].endswith("<|im_end|>")
    out, reason = run(ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert out["text"] == text(forced[:4])


def test_stop_string_truncates_text(llm, expected):
    full = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[: full.index(stop)]


def test_logprobs_are_the_model_distribution(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    assert len(out["logprobs"]) == 4
    for tok, lp in zip(out["token_ids"], out["logprobs"]):
        top = lp["top"]
        assert len(top) == 3 and top[0][0] == tok  # greedy picks the most likely token
        assert lp["logprob"] == pytest.approx(top[0][1], abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        assert np.exp([t[1] for t in top]).sum() <= 1.0 + 1e-5


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "non-empty"),
    ([1] * 5000, SamplingParams(), "maximum context length"),
    ([10**9], SamplingParams(), "token ids"),
])
def test_bad_requests_raise_and_engine_keeps_serving(llm, expected, prompt, params, message):
    engine = llm.engine
    good = engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[good].outputs[0].token_ids == expected[0]


def test_sampling_params_validation():
    for kwargs, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_unknown_model_raises():
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        LLM("no-such-model")


def test_abort_frees_blocks(llm):
    engine = llm.engine
    free = engine.core.block_manager.num_free_blocks
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.core.block_manager.num_free_blocks < free
    engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert engine.core.block_manager.num_free_blocks == free


def test_steady_workload_never_recompiles(llm, caplog):
    workload = lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # noqa: E731
    workload()
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG):
            caplog.clear()
            workload()
            workload()
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == []


def test_a_request_whose_inputs_fail_fails_alone(llm, expected, monkeypatch):
    """If building one request's row of a step still raises, that request finishes with an error
    and the others run on as if it had never been there."""
    from zipage_jax.engine.runner import sampling_batch

    check = sampling_batch.SamplingArrays.check

    def broken(row, width):
        if row.params.seed == 666:
            raise OverflowError("a value the sampler cannot hold")
        check(row, width)

    monkeypatch.setattr(sampling_batch.SamplingArrays, "check", staticmethod(broken))
    params = [GREEDY] * len(PROMPTS) + [SamplingParams(temperature=0.5, seed=666, max_tokens=5)]
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS + [[4, 5]], params)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    failed = finals[ids[-1]]
    assert failed.error is not None and "OverflowError" in failed.error
    assert failed.outputs[0].finish_reason == "error"
    assert [finals[i].outputs[0].token_ids for i in ids[:-1]] == expected
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_usable_blocks
