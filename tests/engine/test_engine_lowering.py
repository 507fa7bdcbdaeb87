"""The engine's compiled steps lower to CUDA for H200s with the Pallas backend (on the CPU).

The runner's jitted functions themselves, the forward step's stages (`engine/runner/forward.py`:
embed, a group of layers, head; decode rows [B, 1], prefill rows [R, C]) and `compaction_program`
(one layer), traced with abstract arguments of the runner's shapes and
lowered for ("cuda",) under abstract H200s: a 2-layer random decoder of the default model's
shape (SmolLM2-135M: 9 / 3 heads, head dim 64) and of Qwen3-8B's (32 / 8 heads, head dim 128),
bfloat16 and float32, blocks of 16 and 256 tokens, model-dtype, int8 and int4 pools, one device
and a `tp` mesh of abstract devices (3 for 3 kv heads, 2 for 8, and 16 for 8 repeated twice:
the Pallas kernels under shard_map see one shard's heads). Decode rows attend with the Pallas decode kernel, prefill
rows with XLA; compression scores and compacts with Pallas. This runs the Triton lowering
of every kernel at the shapes the engine gives it; it compiles no PTX and runs nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from h200 import h200_mesh, lower_for_h200
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import kv_quant
from zipage_jax.backend import Backend
from zipage_jax.config import EngineConfig
from zipage_jax.engine.runner import forward
from zipage_jax.engine.runner.compaction import padding_tables
from zipage_jax.engine.runner.grid import bucket
from zipage_jax.engine.runner.sampling_batch import SamplingArrays
from zipage_jax.engine.runner.steps import DeviceState, compaction_program
from zipage_jax.engine.sharding import TensorParallel, check_divisible
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.paged_attention import StepInputs, uses_block_tables, xla_page_size
from zipage_jax.layers.sampler import SamplerState
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.decoder import Decoder, stages
from zipage_jax.sampling_params import MAX_STOP_TOKEN_IDS

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

NUM_LAYERS = 2
MODELS = {  # (config, tensor-parallel size of the sharded cases)
    "smollm2-135m": (ModelConfig("llama", 49152, 576, 1536, NUM_LAYERS, 9, 3, 64, 1e-5, 1e5, None, 8192, True,
                                 False, False, False, 1, (2,)), 3),
    "qwen3-8b": (ModelConfig("qwen3", 151936, 4096, 12288, NUM_LAYERS, 32, 8, 128, 1e-6, 1e6, None, 40960, False,
                             False, False, True, None, (151645,)), 2),
}
MAX_MODEL_LEN = 8192
MAX_NUM_SEQS = 64  # decode rows, state and query slots
PREFILL_ROWS = 8  # a chunk of 256 tokens in rows of 32
COMPRESS_BATCH = 8  # EngineConfig.max_compress_seqs
COMPRESS_WIDTH = {16: 32, 256: 8}  # bucket(budget blocks + 2) for budgets of 384 / 768 tokens
TRITON_CALL = "stablehlo.custom_call @__gpu$xla.gpu.triton("


@dataclass(frozen=True)
class Case:
    model: str
    dtype: str  # the model's
    block_size: int
    kv_cache_dtype: str  # "auto" | "int8" | "int4"
    tp: int  # 1: one device

    @property
    def id(self) -> str:
        return f"{self.model}-{self.dtype}-bs{self.block_size}-kv{self.kv_cache_dtype}-tp{self.tp}"


DEFAULT_CASES = {  # the default suite's share of the grid
    Case("qwen3-8b", "bfloat16", 16, "int8", 2),
    Case("smollm2-135m", "float32", 256, "auto", 1),
    Case("smollm2-135m", "bfloat16", 16, "int4", 3),
}
GRID = [Case(model, dtype, bs, kv, tp) for model, (_, tp_size) in MODELS.items() for dtype in ("bfloat16", "float32")
        for bs in (16, 256) for kv in ("auto", "int8", "int4") for tp in (1, tp_size)]
GRID += [Case("qwen3-8b", "bfloat16", bs, "int8", 16) for bs in (16, 256)]  # 8 kv heads, each on 2 devices


def _params(grid):
    return [pytest.param(case, id=case.id, marks=() if case in DEFAULT_CASES else pytest.mark.slow) for case in grid]


class Engine:
    """Abstract stand-ins for what ModelRunner passes its compiled steps, for one Case."""

    def __init__(self, case: Case):
        self.case = case
        cfg, _ = MODELS[case.model]
        repeats = check_divisible(cfg, case.tp)  # > 1: kv heads repeated, as shard_ready does
        self.cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * repeats)
        self.dtype = jnp.dtype(case.dtype)
        self.kv_dtype = kv_quant.kv_storage_dtype(case.kv_cache_dtype, self.dtype)
        self.mesh = h200_mesh(case.tp) if case.tp > 1 else None
        self.tp = TensorParallel(self.mesh, kv_repeats=repeats) if self.mesh is not None else None
        self.max_blocks = MAX_MODEL_LEN // case.block_size
        self.num_blocks = 1 + MAX_NUM_SEQS * self.max_blocks // 4
        graphdef, params = nnx.split(Decoder(self.cfg, dtype=self.dtype, rngs=None))
        params = self._abstract(params, None if self.tp is None else self.tp.param_shardings(params))
        self.stages, self.params = stages(nnx.merge(graphdef, params), NUM_LAYERS)
        kv = jax.eval_shape(lambda: KVState.zeros(
            num_layers=NUM_LAYERS, num_blocks=self.num_blocks, block_size=case.block_size,
            num_kv_heads=self.cfg.num_kv_heads, num_heads=self.cfg.num_heads, head_dim=self.cfg.head_dim,
            num_query_slots=MAX_NUM_SEQS, query_cache_len=16, dtype=self.dtype, kv_dtype=self.kv_dtype,
            global_score=True))
        sampler = jax.eval_shape(lambda: SamplerState.zeros(MAX_NUM_SEQS, self.cfg.vocab_size))
        self.state = DeviceState(self._abstract(kv, None if self.tp is None else self.tp.kv_shardings(kv)),
                                 self._abstract(sampler))

    def _abstract(self, tree, shardings=None):
        """ShapeDtypeStructs of `tree`'s arrays, with `shardings` (default: replicated over the mesh)."""
        if self.mesh is None:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
        if shardings is None:
            shardings = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), tree)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)

    def _ints(self, *shape, dtype=jnp.int32):
        return self._abstract(np.zeros(shape, dtype))

    def lower_forward(self, rows: int, chunk: int) -> str:
        """The three stages' lowered text, joined (every layer is in the one group)."""
        bs = self.case.block_size
        by_block = uses_block_tables(Backend.PALLAS, chunk)
        width = self.max_blocks if by_block else self.max_blocks * (bs // xla_page_size(bs))
        per_token = self._ints(rows, chunk)
        inputs = StepInputs(per_token, per_token, per_token, per_token, self._ints(rows, width), per_token,
                            self._ints(rows))
        sampling = self._abstract(SamplingArrays(rows, bucket(MAX_STOP_TOKEN_IDS + 1), MAX_NUM_SEQS,
                                                 self.cfg.vocab_size).batch())
        replicated = NamedSharding(self.mesh, P()) if self.mesh is not None else None
        x = self._abstract(np.zeros((rows, chunk, self.cfg.hidden_size), self.dtype))
        p, static = self.params, dict(mesh=self.mesh, stages=self.stages)
        return "\n".join([
            lower_for_h200(forward._embed, p.embed, self.state.sampler, inputs, sampling, replicated=replicated,
                           **static),
            lower_for_h200(forward._layers, p.groups[0], x, self.state.kv, inputs, backend=Backend.PALLAS, tp=self.tp,
                           replicated=replicated, **static),
            lower_for_h200(forward._head, p.head, x, self.state.sampler, sampling, per_token, self._ints(rows),
                           **static)])

    def lower_compress(self) -> str:
        b, w = COMPRESS_BATCH, COMPRESS_WIDTH[self.case.block_size]
        cfg = EngineConfig().compression
        blocks, per_row = self._abstract(padding_tables(b, w, MAX_NUM_SEQS))
        layer = KVState(self.state.kv.pools[:1], self.state.kv.queries[:1])
        return lower_for_h200(compaction_program, layer, blocks, per_row, self._ints(), mesh=self.mesh, cfg=cfg,
                              backend=Backend.PALLAS, tp=self.tp, rope=())

    # -- what the kernels must see --------------------------------------------------------

    def pool_like(self, shape: tuple[int, ...], *trailing: int) -> bool:
        """Whether `shape` is one shard's pool [..tokens.., Hkv / N, *trailing] (kernels view the
        [NB, BS] token axes as pages of their own size, or flat)."""
        n = len(trailing) + 1
        tokens, heads = shape[:-n], shape[-n:]
        return (math.prod(tokens) == self.num_blocks * self.case.block_size and len(tokens) >= 1
                and heads == (self.cfg.num_kv_heads // self.case.tp, *trailing))

    def count_pools(self, operands, dtype: str | None = None) -> tuple[int, int]:
        """(pools [.., Hkv/N, D], per-token arrays [.., Hkv/N]) among a kernel's operands (of `dtype`)."""
        return self.count_like(operands, dtype, self.cfg.head_dim), self.count_like(operands, dtype)

    def count_like(self, operands, dtype: str | None, *trailing: int) -> int:
        """Operands (of `dtype`) shaped like one shard's pool [..tokens.., Hkv / N, *trailing]."""
        return sum(self.pool_like(s, *trailing) for s, t in operands if dtype is None or t == dtype)

    def check_partitions(self, text: str) -> None:
        assert f"mhlo.num_partitions = {self.case.tp} " in text


def triton_calls(text: str) -> list[tuple[str, list[tuple[tuple[int, ...], str]]]]:
    """(kernel name, operand (shape, dtype)s) of every Triton call in lowered StableHLO text."""
    calls = []
    for line in text.splitlines():
        if TRITON_CALL not in line:
            continue
        line = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir = ...", line)  # the serialized kernel
        name = re.search(r'name = "([^"]+)"', line).group(1)
        operands = re.search(r"\} : \(([^)]*)\) ->", line).group(1)
        calls.append((name, [_tensor_type(t) for t in operands.split(", ")]))
    return calls


def _tensor_type(text: str) -> tuple[tuple[int, ...], str]:
    *dims, dtype = re.fullmatch(r"tensor<(.*)>", text).group(1).split("x")
    return tuple(int(d) for d in dims), dtype


_MLIR_DTYPES = {"bfloat16": "bf16", "float32": "f32", "int8": "i8"}
INT4_GROUP = 32


@pytest.mark.parametrize("case", _params(GRID))
def test_decode_step_lowers_with_the_pallas_kernel_per_shard(case):
    engine = Engine(case)
    text = engine.lower_forward(MAX_NUM_SEQS, 1)
    engine.check_partitions(text)
    calls = triton_calls(text)  # the layers' calls share one outlined kernel
    assert {name.split("_block")[0] for name, _ in calls} == {"paged_decode"}, calls
    quantized = kv_quant.is_quantized(engine.kv_dtype)
    groups = engine.cfg.head_dim // INT4_GROUP
    for _, operands in calls:  # one shard's heads; a quantized pool's scales go with it
        if kv_quant.is_int4(engine.kv_dtype):  # an operand per 32-element group (k and v: per packed pair)
            assert engine.count_like(operands, "ui8", groups // 2, INT4_GROUP) == groups, operands
            assert engine.count_like(operands, "f16", groups) == 2 * groups, operands
            continue
        assert engine.count_pools(operands, _MLIR_DTYPES[engine.kv_dtype.name]) == (2, 0), operands
        assert engine.count_pools(operands, "f32")[1] == (2 if quantized else 0), operands


@pytest.mark.parametrize("case", _params(GRID))
def test_prefill_step_lowers(case):
    engine = Engine(case)
    text = engine.lower_forward(PREFILL_ROWS, 32)
    engine.check_partitions(text)
    assert triton_calls(text) == []  # prefill rows attend with XLA (its TP split is XLA's)


@pytest.mark.parametrize("case", _params(GRID))
def test_compress_step_lowers_with_the_pallas_kernels_per_shard(case):
    engine = Engine(case)
    text = engine.lower_compress()
    engine.check_partitions(text)
    calls = dict(triton_calls(text))
    assert set(calls) == {"zipage_attention_score", "zipage_compact"}, calls
    # its one collective: with repeated kv heads, the gather of each copy's query group
    assert ("stablehlo.all_gather" in text) == (engine.tp is not None and engine.tp.kv_repeats > 1)
    # compaction moves k, v and the per-token arrays (score cache, token positions, scales) as bits,
    # one shard's heads; int4: packed k, v [.., D / 2] and group scales [.., D / 32]
    compacted = calls["zipage_compact"]
    if kv_quant.is_int4(engine.kv_dtype):
        d = engine.cfg.head_dim
        assert [engine.count_like(compacted, None, *t) for t in [(d // 2,), (), (d // INT4_GROUP,)]] == [2, 2, 2]
    else:
        per_token = 2 + 2 * kv_quant.is_quantized(engine.kv_dtype)
        assert engine.count_pools(compacted) == (2, per_token), compacted
    # scoring reads the keys: the pool, or (quantized) the batch's blocks gathered and dequantized
    keys = [s for s, _ in calls["zipage_attention_score"] if s[-3:] == (case.block_size, engine.cfg.num_kv_heads
                                                                        // case.tp, engine.cfg.head_dim)]
    assert keys, calls["zipage_attention_score"]
