"""The forward pass as one program per stage: embed, a group of layers, the head.

One step runs the embed program, the layer-group program once per group of layers (every
group has the same size, so one program serves them all), then the head program (final norm,
LM head, sampling, prompt log-probabilities). Compile time then grows with the group size, not
with the model's depth; each call costs the host a few microseconds. Each program donates the
state it updates: the embed and head programs the sampler's, a group its layers' KV.
"""

from __future__ import annotations

import functools
import logging
import threading

import jax
import jax.numpy as jnp

from zipage_jax.backend import Backend
from zipage_jax.engine.runner.executable_store import ExecutableStore
from zipage_jax.engine.runner.programs import CompiledPrograms, ProgramRecord
from zipage_jax.engine.sharding import TensorParallel
from zipage_jax.layers.kv_cache import KVState
from zipage_jax.layers.paged_attention import StepInputs, paged_attention_fn
from zipage_jax.layers.prompt_logprobs import PromptLogprobs, prompt_logprobs
from zipage_jax.layers.sampler import SamplerOutput, SamplerState, SamplingBatch, record_inputs, sample
from zipage_jax.models.decoder import DecoderStages, StageParams, repeats_layer_pattern

logger = logging.getLogger("zipage_jax")

MAX_LAYERS_PER_GROUP = 8


def layers_per_group(num_layers: int, layer_windows: tuple[int, ...] = ()) -> int:
    """The largest divisor of the depth that is at most MAX_LAYERS_PER_GROUP and whose groups
    repeat the layer pattern (sliding windows, ModelConfig.layer_windows); where none does, the
    smallest larger one (the whole depth at worst: one group)."""
    fits = [d for d in range(1, num_layers + 1) if num_layers % d == 0 and repeats_layer_pattern(layer_windows, d)]
    return max((d for d in fits if d <= MAX_LAYERS_PER_GROUP), default=fits[0])


@functools.partial(jax.jit, static_argnames=("stages", "replicated"), donate_argnames=("sampler",))
def _embed(embed: list[jax.Array], sampler: SamplerState, inputs: StepInputs, sampling: SamplingBatch, *,
           stages: DecoderStages, replicated) -> tuple[jax.Array, SamplerState, StepInputs, SamplingBatch]:
    # returns the step's inputs and sampling rows too: on the device now, the layer groups and the
    # head take them from here (one host-to-device copy per step, made by the call itself:
    # jax.device_put costs far more host time)
    last_sampled = sampler.last_token[sampling.slot][:, None]  # [R, 1]
    tokens = jnp.where(inputs.tokens >= 0, inputs.tokens, last_sampled)  # [R, C]
    sampler = record_inputs(sampler, tokens, inputs.positions, inputs.kv_lens > 0, sampling.slot,
                            sampling.num_prompt, sampling.reset)
    x = stages.embed(embed, tokens)  # [R, C, E]
    inputs, sampling = jax.tree.map(lambda a: _replicate(a, replicated), (inputs, sampling))
    return _replicate(x, replicated), sampler, inputs, sampling


@functools.partial(jax.jit, static_argnames=("stages", "backend", "tp", "replicated"), donate_argnames=("kv",))
def _layers(group: list[list[jax.Array]], x: jax.Array, kv: KVState, inputs: StepInputs, *, stages: DecoderStages,
            backend: Backend, tp: TensorParallel | None, replicated) -> tuple[jax.Array, KVState]:
    # x: [R, C, E]; kv: the group's layers only
    attn = paged_attention_fn(inputs, backend, None if tp is None else tp.per_shard_decode)
    x, kv = stages.layers(group, x, inputs.positions, attn, kv)
    return _replicate(x, replicated), kv if tp is None else tp.constrain_kv(kv)


@functools.partial(jax.jit, static_argnames=("stages",), donate_argnames=("sampler",))
def _head(head: list[jax.Array], x: jax.Array, sampler: SamplerState, sampling: SamplingBatch,
          prompt_targets: jax.Array, last_index: jax.Array, *, stages: DecoderStages
          ) -> tuple[SamplerState, SamplerOutput, PromptLogprobs]:
    # x: [R, C, E] after the last layer; prompt_targets: [R, C] i32 (-1: no prompt logprob); last_index: [R]
    hidden = stages.norm(head, x)
    last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]  # [R, E]
    out, sampler = sample(stages.logits(head, last), sampling, sampler)
    prompt = prompt_logprobs(lambda h: stages.logits(head, h), hidden, prompt_targets)
    return sampler, out, prompt


def _replicate(x: jax.Array, replicated) -> jax.Array:
    """Inside jit: x whole on every device of the mesh (None: one device, nothing to pin), so
    the next stage's program gets it as it was compiled for."""
    return x if replicated is None else jax.lax.with_sharding_constraint(x, replicated)


class StagedForward:
    """Programs keyed like one program ("decode rows", r) / ("prefill rows", r): `get` builds the
    three stages and returns the forward program, run(state, inputs, sampling, prompt_targets) ->
    (state, SamplerOutput, PromptLogprobs)."""

    name = "forward"

    def __init__(self, stages: DecoderStages, params: StageParams, store: ExecutableStore | None, *,
                 backend: Backend, tp: TensorParallel | None, replicated, hidden_dtype):
        self.params, self.replicated, self.hidden_dtype = params, replicated, hidden_dtype
        self.group_size = len(params.groups[0])
        pin = None if tp is None else replicated
        self.embed = CompiledPrograms("embed", _embed, store, stages=stages, replicated=pin)
        self.layers = CompiledPrograms("layers", _layers, store, stages=stages, backend=backend, tp=tp, replicated=pin)
        self.head = CompiledPrograms("head", _head, store, stages=stages)
        self.hidden_size = stages.cfg.hidden_size
        self.executables: dict[tuple, object] = {}  # key -> the forward program, once its three are built
        self._lock = threading.Lock()
        self._building: set[tuple] = set()

    @property
    def records(self) -> dict[tuple, ProgramRecord]:
        return {(programs.name, *key): r for programs in (self.embed, self.layers, self.head)
                for key, r in list(programs.records.items())}

    @property
    def num_built(self) -> int:
        return self.embed.num_built + self.layers.num_built + self.head.num_built

    def ready(self, key: tuple) -> bool:
        return key in self.executables

    def __call__(self, key: tuple, *args):
        return self.get(key, *args)(*args)

    def get(self, key: tuple, state, inputs: StepInputs, sampling: SamplingBatch, prompt_targets):
        """The forward program for `key`, its three built from these arguments (arrays or ShapeDtypeStructs)."""
        forward = self.executables.get(key)
        if forward is not None:
            return forward
        rows, chunk = inputs.tokens.shape
        x = jax.ShapeDtypeStruct((rows, chunk, self.hidden_size), self.hidden_dtype, sharding=self.replicated)
        g = self.group_size
        group_kv = KVState(tuple(state.kv.pools[:g]), tuple(state.kv.queries[:g]))
        p = self.params
        embed = self.embed.get(key, p.embed, state.sampler, inputs, sampling)
        layers = self.layers.get(key, p.groups[0], x, group_kv, inputs)
        head = self.head.get(key, p.head, x, state.sampler, sampling, prompt_targets, inputs.last_index)

        def forward(state, inputs: StepInputs, sampling: SamplingBatch, prompt_targets):
            x, sampler, inputs, sampling = embed(p.embed, state.sampler, inputs, sampling)
            pools, queries = list(state.kv.pools), list(state.kv.queries)
            for i, group in enumerate(p.groups):
                part = slice(i * g, (i + 1) * g)
                x, kv = layers(group, x, KVState(tuple(pools[part]), tuple(queries[part])), inputs)
                pools[part], queries[part] = kv.pools, kv.queries
            sampler, out, prompt = head(p.head, x, sampler, sampling, prompt_targets, inputs.last_index)
            return state._replace(kv=KVState(tuple(pools), tuple(queries)), sampler=sampler), out, prompt

        self.executables[key] = forward
        return forward

    def prefetch(self, key: tuple, *args) -> None:
        """Builds the forward program for `key` on a thread of its own unless it is ready or being built. Not a
        daemon, even when started from one: the interpreter waits for the build before it shuts the
        runtime down."""
        with self._lock:
            if key in self.executables or key in self._building:
                return
            self._building.add(key)

        def build() -> None:
            try:
                self.get(key, *args)
            except Exception:  # noqa: BLE001 - the step that needs it builds it again and raises
                logger.exception("building the forward program %s ahead failed", key)
            finally:
                with self._lock:
                    self._building.discard(key)

        threading.Thread(target=build, name="zipage-prefetch-forward", daemon=False).start()
