"""Log-probabilities of prompt tokens, from the logits at every position of a prefill step.

Position j of a row predicts the token after it: `targets[r, j]` is that token (the next prompt
token, which the host knows), -1 where nothing is asked (padding, a row whose request does not
ask, and a prompt's last position, whose logits give the first sampled token instead). Rows run
one at a time (`lax.map`), so only one row's [C, V] logits exist at once, and a row without a
target computes nothing; a step in which no row asks costs one predicate. Values are per-row
inputs, never static: one compiled step serves requests that ask and requests that do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zipage_jax.layers.sampler import MAX_LOGPROBS, largest, pad_vocab


class PromptLogprobs(NamedTuple):
    logprobs: jax.Array  # [R, C] f32 log_softmax(logits)[target] (0 where the target is -1)
    top_ids: jax.Array  # [R, C, MAX_LOGPROBS] i32, most likely first
    top_logprobs: jax.Array  # [R, C, MAX_LOGPROBS] f32


def prompt_logprobs(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    targets: jax.Array) -> PromptLogprobs:
    """hidden: [R, C, E] after the final norm; targets: [R, C] i32 (-1: none); logits_fn: the LM
    head, [C, E] -> [C, V]. Zeros wherever a row has no target."""
    rows, c = targets.shape

    def nothing(shape: tuple[int, ...]) -> PromptLogprobs:
        k = (*shape, MAX_LOGPROBS)
        return PromptLogprobs(jnp.zeros(shape, jnp.float32), jnp.zeros(k, jnp.int32), jnp.zeros(k, jnp.float32))

    def row(h: jax.Array, t: jax.Array) -> PromptLogprobs:
        raw = pad_vocab(logits_fn(h))  # [C, Vp]
        lse = jax.nn.logsumexp(raw, axis=-1)  # [C]
        own = jnp.take_along_axis(raw, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0] - lse
        values, ids = largest(raw, MAX_LOGPROBS)
        return PromptLogprobs(jnp.where(t >= 0, own, 0.0), ids, values - lse[:, None])

    def one_row(args: tuple[jax.Array, jax.Array]) -> PromptLogprobs:
        h, t = args  # [C, E], [C]
        return lax.cond(jnp.any(t >= 0), row, lambda h, t: nothing((c,)), h, t)

    return lax.cond(jnp.any(targets >= 0), lambda: lax.map(one_row, (hidden, targets)),
                    lambda: nothing((rows, c)))
