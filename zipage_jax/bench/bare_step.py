"""The bare model step: a decode forward and sampling over B rows in one jitted call, with no
engine around it (no scheduler, no block tables to maintain, no outputs): the floor an engine's
decode step is measured against.

Each of the B rows owns contiguous blocks of a fresh pool and decodes at the positions the
engine's rows pass through; every step's host inputs are built before the timing starts, so a
timed step is one dispatch (its inputs copied to the device, as the engine's are) and the read
of its tokens.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import numpy as np

from zipage_jax.backend import Backend
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.paged_attention import StepInputs, paged_attention_fn, xla_page_size
from zipage_jax.layers.sampler import SamplerState, SamplingBatch, mask_words
from zipage_jax.layers.sampler import sample as sample_tokens
from zipage_jax.models.decoder import split
from zipage_jax.models.loading import LoadedModel


class BareStep:
    """B rows decoding positions [first, first + steps) of their own sequences."""

    def __init__(self, loaded: LoadedModel, batch: int, first: int, steps: int, block_size: int):
        cfg = loaded.model.cfg
        self.fns, self.params = split(loaded.model)
        self.backend = Backend.resolve("auto", jax.default_backend())
        self.batch, self.steps = batch, steps
        blocks = -(-(first + steps) // block_size)
        self.kv = KVState.zeros(num_layers=cfg.num_layers, num_blocks=batch * blocks + 1, block_size=block_size,
                                num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                                num_query_slots=1, query_cache_len=1, dtype=loaded.model.dtype,
                                global_score=False)
        self.sampler = SamplerState.zeros(batch, cfg.vocab_size)
        self.inputs = [self._inputs(first + t, blocks, block_size) for t in range(steps)]
        self.sampling = _greedy(batch, cfg.vocab_size)

    def _inputs(self, position: int, blocks: int, block_size: int) -> StepInputs:
        b = self.batch
        first_block = 1 + np.arange(b, dtype=np.int32) * blocks  # block 0 is the padding block
        page = block_size if self.backend.uses_pallas else xla_page_size(block_size)
        per_block = block_size // page
        tables = (first_block[:, None] + np.arange(blocks, dtype=np.int32))  # [B, blocks]
        if per_block > 1:
            tables = (tables[:, :, None] * per_block + np.arange(per_block, dtype=np.int32)).reshape(b, -1)
        slots = (first_block + position // block_size) * block_size + position % block_size
        column = np.full((b, 1), position, np.int32)
        return StepInputs(tokens=np.full((b, 1), 7, np.int32), positions=column, slots=slots[:, None].astype(np.int32),
                          query_index=np.ones((b, 1), np.int32), block_tables=tables.astype(np.int32),
                          kv_lens=column + 1, last_index=np.zeros(b, np.int32))

    def run(self) -> list[float]:
        """Seconds of each of the `steps` steps (the first call compiles: run once untimed)."""
        times = []
        for inputs in self.inputs:
            start = time.perf_counter()
            self.kv, self.sampler, tokens = _step(self.fns, self.backend, self.params, self.kv, self.sampler, inputs,
                                                  self.sampling)
            np.asarray(tokens)
            times.append(time.perf_counter() - start)
        return times

    def median_seconds(self) -> float:
        return statistics.median(self.run())


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _step(fns, backend: Backend, params, kv: KVState, sampler: SamplerState, inputs: StepInputs,
          sampling: SamplingBatch):
    hidden, kv = fns.forward(params, inputs.tokens, inputs.positions, paged_attention_fn(inputs, backend), kv)
    out, sampler = sample_tokens(fns.logits(params, hidden[:, -1]), sampling, sampler)
    return kv, sampler, out.token_ids


def _greedy(b: int, vocab_size: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32), repetition_penalty=np.ones(b, np.float32),
        presence_penalty=np.zeros(b, np.float32), frequency_penalty=np.zeros(b, np.float32),
        seed=np.zeros(b, np.uint32), step=np.zeros(b, np.int32), suppress_ids=np.full((b, 8), -1, np.int32),
        allowed=np.full((b, mask_words(vocab_size)), -1, np.int32), forced=np.full(b, -1, np.int32),
        wants_logprobs=np.zeros(b, bool), slot=np.arange(b, dtype=np.int32), num_prompt=np.zeros(b, np.int32),
        reset=np.zeros(b, bool), samples=np.ones(b, bool))
