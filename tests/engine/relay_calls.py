"""Every relayed runner call with arguments of the types the runner really passes (StepInputs,
SamplingBatch, CompactionTables, numpy arrays, program keys), filled with varied values."""

from __future__ import annotations

import dataclasses

import numpy as np

from zipage_jax.engine.runner.compaction import padding_tables
from zipage_jax.engine.runner.inputs import InputArrays
from zipage_jax.engine.runner.sampling_batch import SamplingArrays

VOCAB = 300


def forward_args(rows: int = 2, chunk: int = 3, seed: int = 0) -> tuple:
    """run_forward's arguments: key, StepInputs, SamplingBatch, prompt targets."""
    rng = np.random.default_rng(seed)
    inputs = InputArrays(rows, chunk, width=4, pad_query=9)
    inputs.tokens[:] = rng.integers(0, VOCAB, (rows, chunk))
    inputs.kv_lens[:] = np.arange(chunk) + 1
    sampling = SamplingArrays(rows, suppress_width=2, pad_slot=8, vocab_size=VOCAB)
    sampling.temperature[:] = rng.random(rows).astype(np.float32)
    sampling.seed[:] = rng.integers(0, 2**32, rows, dtype=np.uint32)
    sampling.reset[0] = True
    targets = np.full((rows, chunk), -1, np.int32)
    targets[0, 0] = 7
    return ("prefill rows", rows), inputs.step_inputs(), sampling.batch(), targets


def compaction_args(b: int = 2, w: int = 4) -> tuple:
    tables = padding_tables(b, w, num_query_slots=5)
    tables.blocks[0, 0, :2] = [3, 4]
    return ("batch", b, "blocks", w), tables


def seed_args() -> tuple:
    tokens = np.full((1, 8), -1, np.int32)
    tokens[0, :3] = [5, 6, 7]
    return ("tokens", 8), np.array([1], np.int32), tokens, np.array([3], np.int32)


def relayed_calls() -> list[tuple[str, tuple]]:
    """(method, arguments) of every relayed runner method."""
    return [("run_forward", forward_args()), ("run_compaction", compaction_args()), ("run_seed", seed_args()),
            ("reset_state", ()), ("prefetch_decode", (5,))]


def assert_same_arguments(got: tuple, expected: tuple) -> None:
    """Equal arguments: the same types, keys, and arrays of the same dtype, shape and values."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert type(a) is type(b)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        elif hasattr(b, "_fields") or dataclasses.is_dataclass(b):  # a NamedTuple or dataclass of arrays
            fields = b._fields if hasattr(b, "_fields") else [f.name for f in dataclasses.fields(b)]
            assert_same_arguments(tuple(getattr(a, f) for f in fields), tuple(getattr(b, f) for f in fields))
        else:  # a program key or a count
            assert a == b
