"""Tensor-parallel checks in a Python of their own, with 4 host devices (run by test_tensor_parallel.py).

    python tests/engine/tp_worker.py MODEL TP [--max-tokens 100] [--kv-budget 32] [--num-prompts 4] [--backend B]
        [--kv-cache-dtype auto|int8|fp8|int4] [--enable-expert-parallel]

Greedy tokens with TP and with one device, full KV and compressed (a per-request kv_budget),
then what the sharded engine looks like: parameter and KV shardings, the collectives in the
compiled steps and the compiles in a repeated workload. Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from runner_backend import use_backend  # noqa: E402

from zipage_jax import LLM  # noqa: E402
from zipage_jax.crosscheck.tp import greedy_tokens  # noqa: E402
from zipage_jax.models.weights import param_key  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37,
           [200, 201]]
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
               dtype="float32", compilation_cache_dir="")
COLLECTIVES = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(steps) -> dict[str, dict[str, list[str]]]:
    """Per compiled executable of `steps` (a runner's CompiledPrograms): collective op name -> the
    result shapes of its ops in the compiled HLO."""
    out = {}
    for key, exe in steps.executables.items():
        ops: dict[str, list[str]] = {}
        for shape, op in COLLECTIVES.findall(exe.as_text()):
            ops.setdefault(op, []).append(shape.split("{")[0])
        out[" ".join(map(str, key))] = ops
    return out


def count_compiles(workload) -> int:
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        workload()
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return sum("Compiling" in r.getMessage() for r in records)


def shardings(llm) -> dict[str, dict]:
    runner = llm.engine.core.runner
    arrays = {param_key(path): var[...] for path, var in nnx.to_flat_state(runner.params)}
    arrays = {k: v for k, v in arrays.items() if k.startswith(("layers.0.", "embed_tokens."))}
    kv, sampler = runner.state
    pool = kv.pools[0]
    arrays.update({"kv.k[0]": pool.k, "kv.v[0]": pool.v, "kv.queries[0]": kv.queries[0]})
    if pool.k_scales is not None:
        arrays.update({"kv.k_scales[0]": pool.k_scales, "kv.v_scales[0]": pool.v_scales})
    arrays.update({f"sampler.{name}": x for name, x in sampler._asdict().items()})
    return {name: {"spec": [None if p is None else str(p) for p in x.sharding.spec], "shape": list(x.shape),
                   "dtype": str(x.dtype),
                   "shard_shape": list(x.addressable_shards[0].data.shape), "devices": len(x.sharding.device_set)}
            for name, x in arrays.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("tp", type=int)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--kv-budget", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--kv-cache-dtype", default="auto", help="the pools of both engines: auto, int8, fp8 or int4")
    parser.add_argument("--enable-expert-parallel", action="store_true", help="the TP engine splits experts whole")
    parser.add_argument("--backend", default="xla", help="the TP engine's attention backend (pallas-interpret: "
                        "the Pallas kernels under shard_map, interpreted)")
    args = parser.parse_args()
    report: dict = {"devices": len(jax.devices())}
    tokens = {}
    for size in (1, args.tp):
        llm = LLM(args.model, tensor_parallel_size=size, kv_cache_dtype=args.kv_cache_dtype,
                  enable_expert_parallel=args.enable_expert_parallel, **OPTIONS)
        runner = llm.engine.core.runner
        if size > 1:
            use_backend(runner, args.backend)
        compressions = llm.engine.stats.num_compressions

        def workload(llm: LLM = llm) -> tuple:
            prompts = PROMPTS[:args.num_prompts]
            return (greedy_tokens(llm, prompts, args.max_tokens),
                    greedy_tokens(llm, prompts, args.max_tokens, args.kv_budget))

        tokens[size] = workload()
        report[f"compressions_tp{size}"] = llm.engine.stats.num_compressions - compressions
        if size > 1:
            programs = runner.num_compiles
            repeated: list = []
            report["compiles_in_steady_state"] = count_compiles(lambda: repeated.extend(workload()))  # noqa: B023
            report["programs_added_in_steady_state"] = runner.num_compiles - programs
            report["repeat_identical"] = tuple(repeated) == tokens[size]
            report["shardings"] = shardings(llm)
            report["num_kv_heads"] = runner.model_config.num_kv_heads  # after any repetition
            report["num_layers"] = llm.engine.core.loaded.config.num_layers
            report["layers_per_group"] = runner.forward.group_size
            report["collectives"] = {name: collectives(steps) for name, steps in (
                ("embed", runner.forward.embed), ("layers", runner.forward.layers), ("head", runner.forward.head),
                ("compression", runner.compressor))}
        llm = workload = None  # the engine goes before the next one is built
    report["tokens"] = {str(size): list(t) for size, t in tokens.items()}
    report["full_identical"] = tokens[1][0] == tokens[args.tp][0]
    report["compressed_identical"] = tokens[1][1] == tokens[args.tp][1]
    report["compressed_differs_from_full"] = tokens[1][0] != tokens[1][1]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
