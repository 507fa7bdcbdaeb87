"""The expert-parallel MLP alone in a Python of its own, with 4 host devices (run by test_expert_parallel.py).

    python tests/model/expert_parallel_worker.py

For 8 experts top-2 over 4 devices (2 experts each), tiled and as ragged_dot, float32 and
bfloat16: the largest difference from grouped_mlp on one device, and the collectives of the
compiled program (every one, tuple-shaped ones too). Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from zipage_jax.layers.moe import expert_parallel_mlp, grouped_mlp, route  # noqa: E402

E, H, I, TOKENS = 8, 64, 32, 37  # noqa: E741
COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                        r"(?:-start)?\(")


def inputs(dtype) -> tuple:
    keys = jax.random.split(jax.random.key(0), 5)
    experts_w = tuple((0.3 * jax.random.normal(key, shape)).astype(dtype)
                      for key, shape in zip(keys, ((E, H, I), (E, H, I), (E, I, H))))
    x = jax.random.normal(keys[3], (TOKENS, H)).astype(dtype)
    weights, experts = route(jax.random.normal(keys[4], (TOKENS, E)) * 3, 2, False)
    return (x, weights, experts) + experts_w


def main() -> None:
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    report = {"devices": len(jax.devices())}
    for dtype in ("float32", "bfloat16"):
        args = inputs(jnp.dtype(dtype))
        placed = [jax.device_put(a, NamedSharding(mesh, P())) for a in args[:3]]
        placed += [jax.device_put(w, NamedSharding(mesh, P("tp"))) for w in args[3:]]
        for tiled in (True, False):
            one = jax.jit(functools.partial(grouped_mlp, tiled=tiled))(*args)
            split = jax.jit(functools.partial(expert_parallel_mlp, mesh, tiled=tiled))
            out = split(*placed)
            name = f"{dtype} {'tiles' if tiled else 'ragged_dot'}"
            report[name] = {
                "max_abs_diff": float(jnp.abs(out.astype(jnp.float32) - one.astype(jnp.float32)).max()),
                "output_norm": float(jnp.abs(one.astype(jnp.float32)).max()),
                "weight_shard_shape": list(placed[3].addressable_shards[0].data.shape),
                "collectives": [(op, shape.split("{")[0]) for shape, op in
                                COLLECTIVE.findall(split.lower(*placed).compile().as_text())]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
