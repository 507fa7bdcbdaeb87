"""What the runner hands back: a dispatched batch's device handles and, once fetched, each
chunk's sampled token and prompt log-probabilities; the requests whose inputs could not be built.

Host-only types (no jax): the scheduler applies them (Scheduler.update_from_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from zipage_jax.engine.scheduler import Chunk
    from zipage_jax.layers.prompt_logprobs import PromptLogprobs
    from zipage_jax.layers.sampler import SamplerOutput


@dataclass
class StepResult:
    """The token a chunk sampled."""

    chunk: Chunk
    token_id: int
    logprob: float
    top_ids: np.ndarray  # [MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [MAX_LOGPROBS]


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
    """A dispatched forward step: the sampling chunks and the output row of each, and the chunks
    with prompt log-probabilities."""

    chunks: list[Chunk]
    rows: list[int]
    outputs: SamplerOutput  # device arrays, still being computed
    prompt_chunks: list[PromptChunk]
    prompt_outputs: PromptLogprobs  # device arrays, read only when prompt_chunks is not empty


@dataclass
class RowFailure:
    """A request whose step inputs could not be built: it fails alone, the step runs without it."""

    chunk: Chunk
    error: Exception


@dataclass
class RunnerOutput:
    """What an engine step read back: results in the order `ModelRunner.fetch` yields them (a
    batch's prompt log-probabilities before its tokens), and the rows its dispatch refused."""

    results: list[StepResult | PromptLogprobsResult] = field(default_factory=list)
    failures: list[RowFailure] = field(default_factory=list)
