"""Host side of the sampler: the running batch's rows (`write_rows`, arrays gathered by row) or one
SamplingRow per chunk, packed into a SamplingBatch's arrays.

Every array has a fixed shape per batch size ([B], suppress ids [B, S] with a fixed S, allowed-token
bitmasks [B, Vp / 32]), so the compiled sampler never changes with the options requests carry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from zipage_jax.engine.grammar import SequenceGrammar, fill_masks
from zipage_jax.engine.running_batch import SAMPLER_OPTIONS, RunningBatch, sampler_option_arrays
from zipage_jax.layers.sampler import SamplingBatch, mask_words
from zipage_jax.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One sequence's sampling inputs for this step, as the engine knows them on the host."""

    params: SamplingParams
    seed: int  # params.seed, or a seed the engine drew once for this request (reduced mod 2**32)
    step: int = 0  # output tokens generated so far: the random stream's position
    suppress_ids: Sequence[int] = ()  # ids banned this step: EOS and stop ids while min_tokens is active
    forced_id: int = -1  # teacher forcing: the token this step outputs whatever is sampled; -1 = none
    slot: int = 0  # the sequence's state slot
    num_prompt_tokens: int = 0
    reset: bool = False  # the sequence's first step since admission: its slot is cleared first
    samples: bool = True  # this row's logits give the sequence's next token
    grammar: SequenceGrammar | None = None  # structured outputs: the sampled token must fit it


class SamplingArrays:
    """Numpy arrays of one SamplingBatch, filled row by row; untouched rows are padding
    (greedy, no penalties, the padding state slot, not sampling)."""

    def __init__(self, batch_size: int, suppress_width: int, pad_slot: int, vocab_size: int):
        b = batch_size
        self.vocab_size = vocab_size
        sampler_option_arrays(self, b)
        self.step = np.zeros(b, np.int32)
        self.suppress_ids = np.full((b, suppress_width), -1, np.int32)
        self.allowed = np.full((b, mask_words(vocab_size)), -1, np.int32)
        self.forced = np.full(b, -1, np.int32)
        self.slot = np.full(b, pad_slot, np.int32)
        self.num_prompt = np.zeros(b, np.int32)
        self.reset = np.zeros(b, bool)
        self.samples = np.zeros(b, bool)
        self.constrained: list[tuple[int, SequenceGrammar]] = []  # rows whose mask their grammar gives

    @staticmethod
    def check(row: SamplingRow, suppress_width: int) -> None:
        """ValueError for a row the arrays cannot hold (validation should have refused it)."""
        if len(row.suppress_ids) > suppress_width:
            raise ValueError(f"{len(row.suppress_ids)} suppressed token ids exceed the sampler's {suppress_width}")
        for name in ("step", "forced_id", "slot", "num_prompt_tokens"):
            value = getattr(row, name)
            if not -1 <= value < 2**31:
                raise ValueError(f"sampling row {name}={value} does not fit in int32")

    def write_rows(self, n: int, running: RunningBatch, rows: np.ndarray, step: np.ndarray) -> None:
        """Rows 0 .. n - 1 sample the next token of the running batch's `rows`, `step` output
        tokens in: their requests' options, EOS and stop ids suppressed before min_tokens."""
        b = running
        for name in SAMPLER_OPTIONS:
            getattr(self, name)[:n] = getattr(b, name)[rows]
        self.step[:n] = step
        early = step < b.min_tokens[rows]
        if early.any():
            suppress = self.suppress_ids.shape[1]
            self.suppress_ids[:n][early] = b.suppress_ids[rows[early], :suppress]
        self.slot[:n] = rows
        self.num_prompt[:n] = b.num_prompt[rows]
        self.samples[:n] = True

    def set(self, i: int, row: SamplingRow) -> None:
        """Row i from `row` (checked with `check`)."""
        sp = row.params
        if not sp.greedy:
            self.temperature[i], self.min_p[i], self.top_p[i] = sp.temperature, sp.min_p, sp.top_p
            self.top_k[i] = min(max(sp.top_k, 0), self.vocab_size)
        self.repetition_penalty[i] = sp.repetition_penalty
        self.presence_penalty[i] = sp.presence_penalty
        self.frequency_penalty[i] = sp.frequency_penalty
        self.seed[i] = row.seed % 2**32
        self.step[i] = row.step
        self.suppress_ids[i, :len(row.suppress_ids)] = row.suppress_ids
        self.forced[i] = row.forced_id
        self.wants_logprobs[i] = sp.logprobs is not None
        self.slot[i] = row.slot
        self.num_prompt[i] = row.num_prompt_tokens
        self.reset[i] = row.reset
        self.samples[i] = row.samples
        if row.grammar is not None and row.samples:
            self.constrained.append((i, row.grammar))

    def batch(self) -> SamplingBatch:
        """The batch, the constrained rows' masks filled from their grammars' current states."""
        fill_masks(self.allowed, self.constrained)
        return SamplingBatch(**{f.name: getattr(self, f.name) for f in fields(SamplingBatch)})

