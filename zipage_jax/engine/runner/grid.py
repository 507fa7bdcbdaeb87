"""What gets compiled: the runner's programs, keyed by shape buckets only, and the grid of every
bucket a configuration can reach.

Buckets are powers of two: decode rows (up to max_num_seqs), prefill rows of `prefill_row_size`
tokens (up to max_num_batched_tokens / prefill_row_size), compaction batch x table width, history
tokens. Context lengths, budgets, policies and sampling options are values, so a warm-up
(warmup.py) can build the whole grid and a steady workload never compiles again; built programs
persist in the executable store, so a restart loads them. While a warm-up still builds the grid,
a step runs in the smallest ready bucket it fits (padding rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pallas_kernels.tiling import next_power_of_two
from zipage_jax.config import EngineConfig
from zipage_jax.engine.pool_plan import KVPoolPlan
from zipage_jax.engine.runner.compaction import padding_tables
from zipage_jax.engine.runner.forward import StagedForward
from zipage_jax.engine.runner.inputs import InputLayout
from zipage_jax.engine.runner.programs import CompiledPrograms, ProgramRecord
from zipage_jax.engine.runner.steps import DeviceState
from zipage_jax.layers.kv_cache import KVState

MIN_HISTORY = 64  # tokens of the smallest history-seeding bucket


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return next_power_of_two(max(n, minimum))


def buckets(limit: int, minimum: int = 1) -> list[int]:
    """Every bucket a count in [1, limit] can fall in."""
    out = [bucket(minimum)]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


@dataclass(frozen=True)
class GridProgram:
    """One program of the warm-up grid: its kind, shape bucket and how to build it."""

    kind: str  # forward, compression, history
    key: tuple
    build: Callable[[], None]
    serving: bool = False  # in the serving set: with these ready, every step can run


class ProgramGrid:
    """The forward programs, the compaction and the history seeding, each built once per bucket from
    the device state's shapes (`abstract_state`), not its buffers."""

    def __init__(self, forward: StagedForward, compressor: CompiledPrograms, seeder: CompiledPrograms, *,
                 config: EngineConfig, pool: KVPoolPlan, layout: InputLayout, abstract_state: DeviceState):
        self.forward, self.compressor, self.seeder = forward, compressor, seeder
        self.config, self.pool, self.layout = config, pool, layout
        self.abstract_state = abstract_state
        self._programs = (forward, compressor, seeder)

    @property
    def records(self) -> list[ProgramRecord]:
        """How every ready program was built (compiled or loaded), with its seconds per stage."""
        return [r for programs in self._programs for r in list(programs.records.values())]

    @property
    def num_compiles(self) -> int:
        """Programs built: compiled here or loaded from the executable store (a forward program's
        stages count one each)."""
        return sum(programs.num_built for programs in self._programs)  # every step reads it: no list built

    @property
    def compile_seconds(self) -> float:
        """Seconds spent building every program so far (tracing, lowering, compiling or loading)."""
        return sum(r.seconds for r in self.records)

    # -- the bucket a step runs in --------------------------------------------------------

    def forward_key(self, is_decode: bool, num_rows: int) -> tuple:
        return _ready_key(self.forward, ("decode rows" if is_decode else "prefill rows", bucket(num_rows)))

    def compress_key(self, num_seqs: int, num_blocks: int) -> tuple:
        return _ready_key(self.compressor, ("batch", bucket(num_seqs), "blocks", bucket(num_blocks, 2)))

    def history_key(self, num_tokens: int) -> tuple:
        return _ready_key(self.seeder, ("tokens", bucket(num_tokens, MIN_HISTORY)))

    def prefetch_decode(self, num_rows: int) -> None:
        """Builds the decode program for `num_rows` rows on a thread of its own unless one is ready."""
        r = bucket(num_rows)
        if not self.forward.ready(_ready_key(self.forward, ("decode rows", r))):
            self.forward.prefetch(*self._forward_shapes(r, 1))

    # -- warm-up --------------------------------------------------------------------------

    def step_grid(self) -> list[GridProgram]:
        """Every program the configuration can reach, the serving set first: the largest bucket of
        each kind, which every step fits in by padding, so a warm-up can serve once those are ready."""
        cfg, row_size = self.config, self.config.row_size
        grid = []
        for r in buckets(cfg.max_num_seqs):
            grid.append(GridProgram("forward", ("decode rows", r), functools.partial(self._compile_forward, r, 1)))
        for r in buckets(max(1, cfg.max_num_batched_tokens // row_size)):
            grid.append(GridProgram("forward", ("prefill rows", r),
                                    functools.partial(self._compile_forward, r, row_size)))
        for b in buckets(cfg.max_compress_seqs):
            for w in buckets(self.pool.max_blocks_per_seq, 2):
                grid.append(GridProgram("compression", ("batch", b, "blocks", w),
                                        functools.partial(self._compile_compress, b, w)))
        for n in buckets(self.pool.max_model_len, MIN_HISTORY):
            grid.append(GridProgram("history", ("tokens", n), functools.partial(self._compile_seed, n)))
        largest = {}
        for program in grid:  # buckets ascend: the last of a kind and layout is its largest
            largest[(program.kind, program.key[0::2])] = program
        serving = [dataclasses.replace(p, serving=True) for p in largest.values()]
        return serving + [p for p in grid if p not in largest.values()]

    def _compile_forward(self, r: int, c: int) -> None:
        self.forward.get(*self._forward_shapes(r, c))

    def _forward_shapes(self, r: int, c: int) -> tuple:
        """(key, *arguments) of the forward program for r rows of c tokens."""
        inputs, sampling = self.layout.arrays(r, c)
        return (("decode rows" if c == 1 else "prefill rows", r), self.abstract_state, inputs.step_inputs(),
                sampling.batch(), inputs.prompt_targets)

    def _compile_compress(self, b: int, w: int) -> None:
        kv = self.abstract_state.kv
        tables = padding_tables(b, w, self.layout.num_query_slots)
        self.compressor.get(("batch", b, "blocks", w), KVState(kv.pools[:1], kv.queries[:1]), *tables, np.int32(0))

    def _compile_seed(self, n: int) -> None:
        one = np.zeros(1, np.int32)
        self.seeder.get(("tokens", n), self.abstract_state, one, np.zeros((1, n), np.int32), one)


def _ready_key(programs: CompiledPrograms | StagedForward, key: tuple) -> tuple:
    """`key`, or while the warm-up still compiles it, the smallest ready program of the same
    kind that every dimension of `key` fits in (its rows are padding)."""
    if programs.ready(key):
        return key
    fits = [k for k in list(programs.executables) if k[0::2] == key[0::2]
            and all(have >= need for have, need in zip(k[1::2], key[1::2]))]
    return min(fits, key=lambda k: math.prod(k[1::2])) if fits else key
