"""What the runner hands back: a dispatched batch's device handles and, once fetched, the tokens its
rows sampled (by batch row, as arrays) and the chunks' prompt log-probabilities; the requests
whose inputs could not be built.

Host-only types (no jax): the scheduler applies them (Scheduler.update_from_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from zipage_jax.engine.scheduler import Chunk
    from zipage_jax.layers.prompt_logprobs import PromptLogprobs
    from zipage_jax.layers.sampler import SamplerOutput


@dataclass
class PromptLogprobsResult:
    """Log-probabilities of prompt tokens first .. first + n - 1 of `chunk.seq`, from one chunk."""

    chunk: Chunk
    first: int  # prompt index of the first entry: the chunk's start + 1
    logprobs: np.ndarray  # [n] of each prompt token
    top_ids: np.ndarray  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, MAX_LOGPROBS]


@dataclass
class PromptChunk:
    """Where a chunk's prompt log-probabilities lie in a batch's outputs."""

    chunk: Chunk
    row: int  # the chunk's first row; its positions follow row by row
    num_entries: int


@dataclass
class PendingBatch:
    """A dispatched forward step: which running-batch rows sample, at which output row, and the
    rows' epochs then (RunningBatch.epoch); the chunks with prompt log-probabilities."""

    rows: np.ndarray  # [n] running-batch rows that sample
    epochs: np.ndarray  # [n]
    out_rows: np.ndarray  # [n] their rows of the outputs
    outputs: SamplerOutput  # device arrays, still being computed
    prompt_chunks: list[PromptChunk]
    prompt_outputs: PromptLogprobs  # device arrays, read only when prompt_chunks is not empty
    constrained: bool = False  # a structured output's row samples
    wants_logprobs: bool = False  # some row asked for log-probabilities: the top ones are read back


@dataclass
class FetchedStep:
    """A dispatched step's results on the host: row `rows[i]` (epoch `epochs[i]`) sampled
    `tokens[i]`; its prompt log-probabilities; what it computed and the seconds since the step
    read before it."""

    rows: np.ndarray  # [n]
    epochs: np.ndarray  # [n]
    tokens: np.ndarray  # [n] i32
    token_logprobs: np.ndarray  # [n] f32
    top_ids: np.ndarray  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, MAX_LOGPROBS]
    prompt_logprobs: list[PromptLogprobsResult] = field(default_factory=list)
    num_prefill: int = 0
    num_decode: int = 0
    seconds: float = 0.0

    def logprobs(self, picked: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logprob, top ids, top logprobs) of the entries `picked`."""
        return self.token_logprobs[picked], self.top_ids[picked], self.top_logprobs[picked]


@dataclass
class RowFailure:
    """A request whose step inputs could not be built: it fails alone, the step runs without it."""

    chunk: Chunk
    error: Exception


class CompactionFailed(RuntimeError):
    """A step failed in its compaction program: the failure is the compacting sequences' (`seq_ids`)."""

    def __init__(self, seq_ids: list[int], error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.seq_ids = seq_ids


@dataclass
class RunnerOutput:
    """What a step did on the device and read back: the requests whose inputs it refused, the
    earlier steps' results the host may read now (in dispatch order), and the seconds it waited
    for them."""

    fetched: list[FetchedStep] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)
    wait_seconds: float = 0.0
    # [len(measure_rows), w] what each measured row would evict keeping j blocks (ModelRunner.measure)
    measured: np.ndarray | None = None
