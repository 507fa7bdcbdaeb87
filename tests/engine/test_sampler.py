import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zipage_jax.engine.runner.sampling_batch import SamplingArrays, SamplingRow
from zipage_jax.layers import sampler
from zipage_jax.layers.sampler import SamplerState, record_inputs, sample
from zipage_jax.sampling_params import SamplingParams as SP

V = 300  # not a multiple of 128: exercises the padding
SUPPRESS = 8


def _logits(b: int, v: int = V, scale: float = 3.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((b, v)) * scale).astype(np.float32)


def _row(sp: SP, seed: int, **fields) -> SamplingRow:
    return SamplingRow(sp, seed=seed, **fields)


def _batch(rows: list[SamplingRow], batch_size: int, vocab: int = V):
    # row i uses state slot i; the padding slot is batch_size
    arrays = SamplingArrays(batch_size, SUPPRESS, pad_slot=batch_size, vocab_size=vocab)
    for i, row in enumerate(rows):
        arrays.check(row, SUPPRESS)
        arrays.set(i, dataclasses.replace(row, slot=i))
    return arrays.batch()


def _state(histories: dict[int, tuple[list[int], list[int]]], batch_size: int, vocab: int = V) -> SamplerState:
    """Slot i has seen prompt + output tokens histories[i], counted as the engine counts them."""
    state = SamplerState.zeros(batch_size, vocab)
    for i, (prompt, output) in histories.items():
        tokens = np.array([prompt + output], np.int32)
        state = record_inputs(state, tokens, np.arange(tokens.shape[1], dtype=np.int32)[None], tokens >= 0,
                              np.array([i], np.int32), np.array([len(prompt)], np.int32), np.array([True]))
    return state


def _run(logits: np.ndarray, rows: list[SamplingRow], batch_size: int | None = None,
         histories: dict[int, tuple[list[int], list[int]]] | None = None):
    b = batch_size or len(rows)
    batch = _batch(rows, b, logits.shape[1])
    padded = np.zeros((b, logits.shape[1]), np.float32)
    padded[: len(logits)] = logits
    out, _ = sample(jnp.asarray(padded), batch, _state(histories or {}, b, logits.shape[1]))
    return jax.device_get(out)


def _support(x: np.ndarray, sp: SP) -> set[int]:
    """Tokens a row may draw: numpy twin of temperature, top-k, top-p (renormalised) and min-p."""
    if sp.greedy:
        return {int(np.argmax(x))}
    p = np.exp((x - x.max()) / sp.temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(len(x), bool)
    if 0 < sp.top_k < len(x):
        keep[order[sp.top_k:]] = False
    if sp.top_p < 1:
        q = np.where(keep, p, 0)[order] / p[keep].sum()
        before = np.cumsum(q) - q
        keep[order[before >= sp.top_p]] = False
    keep &= p >= sp.min_p * p.max()
    return set(np.flatnonzero(keep).tolist())


def _penalised(x: np.ndarray, sp: SP, prompt: list[int], output: list[int]) -> np.ndarray:
    """numpy twin of the penalties: repetition on prompt + output, presence / frequency on output."""
    x = x.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= sp.frequency_penalty * count + sp.presence_penalty
    return x


def test_greedy_is_argmax_with_first_index_on_ties():
    x = _logits(5)
    x[1, [17, 250]] = 100.0  # tie: the first index wins, as jnp.argmax
    x[2, 299] = 100.0  # the last real token, next to the padding
    out = _run(x, [_row(SP(temperature=0), seed=0)] * 5, batch_size=8)
    np.testing.assert_array_equal(out.token_ids[:5], np.argmax(x, axis=-1))
    assert out.token_ids[1] == 17 and out.token_ids[2] == 299


def test_greedy_rows_in_a_random_batch_are_argmax():
    x = _logits(6)
    x[4, [9, 40]] = 50.0
    params = [SP(temperature=0), SP(temperature=0.9, top_p=0.8)] * 3
    out = _run(x, [_row(sp, seed=i) for i, sp in enumerate(params)])
    np.testing.assert_array_equal(out.token_ids[::2], np.argmax(x[::2], axis=-1))
    assert out.token_ids[4] == 9


def test_one_compiled_sampler_serves_every_mix_and_never_sorts():
    x = jnp.asarray(_logits(4))
    state = _state({}, 4)
    mixes = [[SP(temperature=0)] * 4, [SP(temperature=0.7, top_p=0.9)] * 4, [SP(temperature=0.7, top_k=5)] * 4,
             [SP(repetition_penalty=1.2, logprobs=3), SP(temperature=0), SP(min_tokens=1, max_tokens=2), SP()]]
    before = sample._cache_size()
    for params in mixes:
        batch = _batch([_row(sp, seed=1) for sp in params], 4)
        sample(x, batch, state)
    assert sample._cache_size() - before <= 1  # options are values, not compile-time flags
    ops = set(re.findall(r"= (\w+)[\[ ]", str(jax.make_jaxpr(sample)(x, batch, state))))
    assert "sort" not in ops and "cond" in ops  # costly stages run only when a row needs them


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.5}, {"min_p": 0.2}])
def test_top_k_1_is_greedy(extra):
    x = _logits(8)
    rows = [_row(SP(temperature=1.5, top_k=1, **extra), seed=i, step=3) for i in range(8)]
    out = _run(x, rows)
    np.testing.assert_array_equal(out.token_ids, np.argmax(x, axis=-1))


def test_tiny_top_p_keeps_only_the_top_token():
    x = _logits(8, scale=0.3)  # flat: the top token holds well under 1% of the mass
    out = _run(x, [_row(SP(top_p=1e-6), seed=i) for i in range(8)])
    np.testing.assert_array_equal(out.token_ids, np.argmax(x, axis=-1))


def test_min_p_one_keeps_only_the_top_token():
    x = _logits(8)
    out = _run(x, [_row(SP(temperature=2.0, min_p=1.0), seed=i) for i in range(8)])
    np.testing.assert_array_equal(out.token_ids, np.argmax(x, axis=-1))


def test_seeded_rows_reproducible_regardless_of_batch():
    x = _logits(8, seed=1)
    x[3] = _logits(1, scale=0.1, seed=2)[0]  # a flat row: its nucleus is too deep for the candidates
    target = SP(temperature=0.9, top_p=0.9, seed=1234)
    others = [SP(temperature=0), SP(temperature=1.3, top_k=7), SP(temperature=0.8, top_p=0.95),
              SP(temperature=0.5, frequency_penalty=1.0), SP(), SP(min_p=0.3), SP(temperature=0, logprobs=3)]
    for row_logits in (x[0], x[3]):  # a row the candidates cover, a row that needs the bisection
        for step in range(3):
            alone = _run(row_logits[None], [_row(target, seed=1234, step=step)])
            for position in (0, 5):
                rows = [_row(sp, seed=i, step=9, num_prompt_tokens=1) for i, sp in enumerate(others)]
                rows.insert(position, _row(target, seed=1234, step=step))
                batch_logits = np.insert(np.delete(x, position, axis=0), position, row_logits, axis=0)
                histories = {i: ([1], [2, 2]) for i in range(len(rows)) if i != position}
                mixed = _run(batch_logits, rows, batch_size=16, histories=histories)
                assert mixed.token_ids[position] == alone.token_ids[0], (step, position)


def test_seed_and_step_change_the_draw():
    x = np.zeros((1, V), np.float32)  # uniform: every token equally likely
    draws = {int(_run(x, [_row(SP(), seed=s, step=t)]).token_ids[0]) for s in range(4) for t in range(4)}
    assert len(draws) >= 12  # 16 draws from 300 tokens: collisions are rare
    again = {int(_run(x, [_row(SP(), seed=s, step=t)]).token_ids[0]) for s in range(4) for t in range(4)}
    assert draws == again
    wrapped = _run(x, [_row(SP(), seed=2**32 + 3, step=1)]).token_ids[0]
    assert wrapped == _run(x, [_row(SP(), seed=3, step=1)]).token_ids[0]


@pytest.mark.parametrize("sp", [SP(temperature=0.7), SP(temperature=1.0, top_k=4), SP(temperature=1.2, top_p=0.7),
                                SP(temperature=1.0, top_k=5, top_p=0.8), SP(temperature=1.0, min_p=0.15)])
def test_draws_follow_the_filtered_distribution(sp):
    v, n, steps = 10, 256, 8
    x = np.linspace(2.0, -1.0, v).astype(np.float32)[np.random.default_rng(3).permutation(v)]
    keep = _support(x, sp)
    p = np.where(np.isin(np.arange(v), list(keep)), np.exp(x / sp.temperature), 0.0)
    p /= p.sum()
    counts = np.zeros(v)
    for step in range(steps):
        out = _run(np.tile(x, (n, 1)), [_row(sp, seed=i, step=step) for i in range(n)])
        counts += np.bincount(out.token_ids, minlength=v)
    total = n * steps
    assert set(np.flatnonzero(counts)) <= keep
    sigma = np.sqrt(p * (1 - p) / total)
    np.testing.assert_array_less(np.abs(counts / total - p), 4.5 * sigma + 1e-9)


@pytest.mark.parametrize("sp", [SP(temperature=0.8, top_k=20), SP(temperature=1.1, top_p=0.6),
                                SP(temperature=1.0, top_k=40, top_p=0.9), SP(temperature=0.6, min_p=0.05),
                                SP(temperature=1.0, top_k=150), SP(temperature=0.9, top_p=0.9),
                                SP(temperature=1.0, top_k=100, top_p=0.8)])
@pytest.mark.parametrize("vocab, scale", [(V, 3.0), (5000, 3.0), (5000, 0.2)])
def test_kept_set_matches_numpy(sp, vocab, scale):
    """The threshold the sampler keeps p >= ..., against a sorting numpy twin, through the candidate
    path and the bisection path (a flat 5000-token row, top_k=150 > the 64 candidates)."""
    x = _logits(4, vocab, scale, seed=7)
    batch = _batch([_row(sp, seed=0)] * 4, 4, vocab)
    scaled = jnp.asarray(x) / sp.temperature
    p = jnp.pad(jnp.exp(scaled - scaled.max(-1, keepdims=True)), ((0, 0), (0, -vocab % 128)))  # as sample pads
    threshold = np.asarray(jnp.maximum(jax.jit(sampler._top_k_p_threshold)(p, batch.top_k, batch.top_p), batch.min_p))
    for row in range(4):
        kept = set(np.flatnonzero(np.asarray(p[row]) >= threshold[row]).tolist())
        assert kept == _support(x[row], sp), row


def test_draws_stay_in_the_kept_set():
    x = _logits(16, 5000, 0.3, seed=5)
    params = [SP(temperature=0.9, top_p=0.9), SP(top_k=200), SP(top_k=30, top_p=0.5), SP(min_p=0.9)] * 4
    for step in range(3):
        out = _run(x, [_row(sp, seed=i, step=step) for i, sp in enumerate(params)])
        for row, sp in enumerate(params):
            assert out.token_ids[row] in _support(x[row], sp)


def test_penalties_match_the_formulas():
    prompt, output = [3, 5, 5, 7, 299], [5, 9, 9, 9, 12, 3]
    params = [SP(repetition_penalty=1.3), SP(presence_penalty=0.7), SP(frequency_penalty=0.4),
              SP(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5), SP()]
    x = _logits(5)
    x[:, [3, 5, 9]] = [2.0, -1.5, 0.0]  # positive, negative and zero logits among the seen tokens
    rows = [_row(sp, seed=0, step=len(output), num_prompt_tokens=len(prompt)) for sp in params]
    batch = _batch(rows, 8)
    state = _state({i: (prompt, output) for i in range(5)}, 8)  # the counts the engine keeps on the device
    padded = jnp.pad(jnp.asarray(np.concatenate([x, np.zeros((3, V), np.float32)])), ((0, 0), (0, 84)))
    got = np.asarray(sampler._penalise(padded, batch, state))[:5, :V]
    for row, sp in enumerate(params):
        np.testing.assert_allclose(got[row], _penalised(x[row], sp, prompt, output), rtol=1e-6, atol=1e-6)


def test_penalties_steer_greedy_choice():
    x = np.zeros((2, V), np.float32)
    x[:, 10], x[:, 11] = 2.0, 1.5
    rows = [_row(SP(temperature=0, frequency_penalty=0.3), seed=0, num_prompt_tokens=1),
            _row(SP(temperature=0, repetition_penalty=1.5), seed=0, num_prompt_tokens=1)]
    out = _run(x, rows, histories={0: ([1], [10, 10]), 1: ([10], [4])})
    assert out.token_ids.tolist() == [11, 11]  # 2 - 0.6 < 1.5, and 2 / 1.5 < 1.5


def test_min_tokens_suppression():
    x = _logits(4)
    x[:, 7] = 30.0  # "EOS" dominates every row
    rows = [_row(SP(temperature=0), seed=0, suppress_ids=(7,)),
            _row(SP(temperature=0), seed=0),
            _row(SP(), seed=1, suppress_ids=(7, 8)),
            _row(SP(), seed=2)]
    out = _run(x, rows)
    assert out.token_ids[0] == np.argmax(np.where(np.arange(V) == 7, -np.inf, x[0]))
    assert out.token_ids[1] == 7 and out.token_ids[3] == 7 and out.token_ids[2] not in (7, 8)
    for step in range(20):
        out = _run(np.tile(x[2], (2, 1)), [_row(SP(temperature=5.0, top_p=0.99), seed=s, step=step,
                                                          suppress_ids=(7, 8)) for s in range(2)])
        assert not set(out.token_ids.tolist()) & {7, 8}


@pytest.mark.parametrize("vocab", [V, 5000])
def test_logprobs_are_raw_log_softmax(vocab):
    x = _logits(4, vocab)
    rows = [_row(SP(temperature=0, logprobs=5), seed=0),
            _row(SP(temperature=0.5, top_k=3, repetition_penalty=1.5), seed=1),
            _row(SP(temperature=1.0, logprobs=0), seed=2),
            _row(SP(temperature=0, logprobs=2), seed=3, suppress_ids=(int(np.argmax(x[3])),))]
    out = _run(x, rows, histories={1: ([1, 2], [])})
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(out.logprobs, ref[np.arange(4), out.token_ids], rtol=1e-5, atol=1e-5)
    order = np.argsort(-ref, axis=-1)[:, :sampler.MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(out.top_logprobs, axis=-1) <= 0)


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    """[B, Vp] bool -> [B, Vp / 32] int32 words, token t at bit t % 32 of word t // 32 (numpy's own packing)."""
    return np.packbits(allowed, axis=-1, bitorder="little").view(np.int32)


def test_allowed_mask_restricts_every_kind_of_row_and_keeps_raw_logprobs():
    x = _logits(6)
    vp = sampler.mask_words(V) * 32
    rng = np.random.default_rng(3)
    allowed = rng.random((6, vp)) < 0.05  # a few tokens each, padding ids included (they have no logit)
    allowed[:, 123] = True  # never empty among the real ids
    allowed[5] = True  # an unconstrained row
    params = [SP(temperature=0), SP(temperature=0, repetition_penalty=1.4), SP(temperature=1.0, seed=1),
              SP(temperature=0.7, top_k=3, top_p=0.9), SP(temperature=1.5, min_p=0.1), SP(temperature=0)]
    rows = [_row(sp, seed=i, num_prompt_tokens=1) for i, sp in enumerate(params)]
    histories = {1: ([1], [int(np.argmax(np.where(allowed[1, :V], x[1], -np.inf)))])}
    masked = np.where(allowed[:, :V], x, -np.inf)
    for step in range(5):
        batch = dataclasses.replace(_batch([dataclasses.replace(r, step=step) for r in rows], 8),
                                    allowed=_bitmask(np.pad(allowed, ((0, 2), (0, 0)), constant_values=True)))
        state = _state(histories, 8)
        out, _ = sample(jnp.asarray(np.pad(x, ((0, 2), (0, 0)))), batch, state)
        out = jax.device_get(out)
        tokens = out.token_ids[:6]
        assert all(allowed[i, t] and t < V for i, t in enumerate(tokens))
        assert tokens[0] == np.argmax(masked[0]) and tokens[5] == np.argmax(x[5])
        penalised = _penalised(x[1], params[1], *histories[1])
        assert tokens[1] == np.argmax(np.where(allowed[1, :V], penalised, -np.inf))
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
        np.testing.assert_allclose(out.logprobs[:6], ref[np.arange(6), tokens], rtol=1e-5, atol=1e-5)


def test_a_single_allowed_token_is_drawn_by_random_rows():
    x = _logits(4, 5000, seed=2)
    vp = sampler.mask_words(5000) * 32
    allowed = np.zeros((4, vp), bool)
    only = [0, 4999, 2048, 77]
    allowed[np.arange(4), only] = True
    rows = [_row(SP(temperature=t, top_k=k), seed=i) for i, (t, k) in enumerate([(1.0, 0), (2.0, 5), (0.3, 0), (0, 0)])]
    batch = dataclasses.replace(_batch(rows, 4, 5000), allowed=_bitmask(allowed))
    out, _ = sample(jnp.asarray(x), batch, _state({}, 4, 5000))
    assert out.token_ids.tolist() == only


def test_forced_rows_output_the_forced_token_with_its_log_softmax():
    x = _logits(3)
    rows = [_row(SP(temperature=0), seed=0, forced_id=7),
            _row(SP(temperature=0.8, top_k=2), seed=1, forced_id=int(np.argmin(x[1]))),
            _row(SP(temperature=0), seed=2)]  # not forced: argmax
    out = _run(x, rows, batch_size=4)
    assert out.token_ids[:3].tolist() == [7, int(np.argmin(x[1])), int(np.argmax(x[2]))]
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_allclose(out.logprobs[:3], ref[np.arange(3), out.token_ids[:3]], rtol=1e-5, atol=1e-5)


def test_no_logprobs_gives_zero_top_arrays():
    out = _run(_logits(2), [_row(SP(temperature=0), seed=0)] * 2)
    assert out.top_ids.shape == (2, sampler.MAX_LOGPROBS) and not out.top_ids.any() and not out.top_logprobs.any()


def test_sampling_rows_write_last_token_into_their_slots():
    x = _logits(3)
    rows = [_row(SP(temperature=0), seed=0), _row(SP(temperature=0), seed=0, samples=False),
            _row(SP(temperature=0), seed=0)]
    batch = _batch(rows, 4)
    out, state = sample(jnp.asarray(np.concatenate([x, np.zeros((1, V), np.float32)])), batch, _state({}, 4))
    last = np.asarray(state.last_token)
    assert last[0] == out.token_ids[0] and last[2] == out.token_ids[2] and last[1] == 0  # row 1 does not sample


def test_record_inputs_counts_outputs_masks_prompt_and_resets():
    state = _state({0: ([3, 3, 4], [5, 5, 5, 3])}, 2)
    counts, prompt = np.asarray(state.output_counts[0]), np.asarray(state.prompt_mask[0])
    assert counts[5] == 3 and counts[3] == 1 and counts.sum() == 4
    assert prompt[3] and prompt[4] and prompt.sum() == 2
    # a new sequence in the same slot starts clean; padding tokens (valid False) count nothing
    tokens = np.array([[7, 8, 0]], np.int32)
    state = record_inputs(state, tokens, np.array([[0, 1, 2]], np.int32), np.array([[True, True, False]]),
                          np.array([0], np.int32), np.array([1], np.int32), np.array([True]))
    counts, prompt = np.asarray(state.output_counts[0]), np.asarray(state.prompt_mask[0])
    assert counts.tolist() == [0] * 8 + [1] + [0] * (V - 9) and prompt.nonzero()[0].tolist() == [7]


def test_builder_pads_rows():
    rows = [_row(SP(temperature=0.5, top_k=-1, logprobs=20), seed=-1, step=4),
            _row(SP(temperature=0, top_p=0.5, top_k=3), seed=7, step=2, suppress_ids=(1, 2, 3)),
            _row(SP(temperature=1.0, top_k=10_000), seed=0)]
    batch = _batch(rows, 4)
    np.testing.assert_array_equal(batch.temperature, [0.5, 0, 1.0, 0])
    np.testing.assert_array_equal(batch.top_k, [0, 0, V, 0])  # -1 is off; greedy rows ignore top-k; clamped to V
    np.testing.assert_array_equal(batch.top_p, [1, 1, 1, 1])
    np.testing.assert_array_equal(batch.seed, np.array([2**32 - 1, 7, 0, 0], np.uint32))
    np.testing.assert_array_equal(batch.step, [4, 2, 0, 0])
    np.testing.assert_array_equal(batch.suppress_ids[:2], [[-1] * SUPPRESS, [1, 2, 3] + [-1] * (SUPPRESS - 3)])
    np.testing.assert_array_equal(batch.slot, [0, 1, 2, 4])  # padding row: the padding slot
    np.testing.assert_array_equal(batch.wants_logprobs, [True, False, False, False])
    assert batch.allowed.shape == (4, sampler.mask_words(V)) and (batch.allowed == -1).all()  # no row constrained


def test_sampling_rows_and_sample_reject_bad_shapes():
    with pytest.raises(ValueError, match="suppressed token ids"):
        _batch([_row(SP(), seed=0, suppress_ids=tuple(range(SUPPRESS + 1)))], 2)
    batch = _batch([_row(SP(), seed=0)], 2)
    with pytest.raises(ValueError, match=r"logits must be \[B=2, V\], got \(3, 300\)"):
        sample(jnp.zeros((3, V)), batch, _state({}, 2))
