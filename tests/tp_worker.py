"""Tensor-parallel checks in a Python of their own, with 4 host devices (run by test_tensor_parallel.py).

    python tests/tp_worker.py MODEL TP [--max-tokens 100] [--kv-budget 32] [--num-prompts 4] [--backend B]

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

from zipage_jax import LLM  # noqa: E402
from zipage_jax.crosscheck.tp import greedy_tokens  # noqa: E402
from zipage_jax.engine import runner as runner_module  # noqa: E402
from zipage_jax.models.weights import param_key  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37,
           [200, 201]]
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
               dtype="float32", compilation_cache_dir="")
COLLECTIVES = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


class StepRecorder:
    """Wraps the runner's jitted steps to keep each kind's first arguments (as shapes + shardings)."""

    def __init__(self):
        self.calls: dict[str, tuple] = {}
        for name in ("_forward_and_sample", "_compress"):
            setattr(runner_module, name, self._wrap(name, getattr(runner_module, name)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            kind = name
            if name == "_forward_and_sample":
                kind += "/decode" if args[4].tokens.shape[1] == 1 else "/prefill"
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array)
                else x, (args, kwargs))
            self.calls.setdefault(kind, (fn, abstract))
            return fn(*args, **kwargs)
        return wrapper

    def collectives(self) -> dict[str, dict[str, list[str]]]:
        """Per recorded step: collective op name -> the result shapes of its ops in the compiled HLO."""
        out = {}
        for kind, (fn, (args, kwargs)) in self.calls.items():
            hlo = fn.lower(*args, **kwargs).compile().as_text()
            ops: dict[str, list[str]] = {}
            for shape, op in COLLECTIVES.findall(hlo):
                ops.setdefault(op, []).append(shape.split("{")[0])
            out[kind] = ops
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
    runner = llm.engine.runner
    arrays = {param_key(path): var[...] for path, var in nnx.to_flat_state(runner.params)}
    arrays = {k: v for k, v in arrays.items() if k.startswith(("layers.0.", "embed_tokens."))}
    arrays.update({"kv.k[0]": runner.kv.k[0], "kv.v[0]": runner.kv.v[0], "kv.queries[0]": runner.kv.queries[0]})
    return {name: {"spec": [None if p is None else str(p) for p in x.sharding.spec], "shape": list(x.shape),
                   "shard_shape": list(x.addressable_shards[0].data.shape), "devices": len(x.sharding.device_set)}
            for name, x in arrays.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("tp", type=int)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--kv-budget", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--backend", default="xla", help="the TP engine's attention backend (pallas-interpret: "
                        "the Pallas kernels under shard_map, interpreted)")
    args = parser.parse_args()
    report: dict = {"devices": len(jax.devices())}
    tokens = {}
    for size in (1, args.tp):
        recorder = StepRecorder() if size > 1 else None
        llm = LLM(args.model, tensor_parallel_size=size, **OPTIONS)
        if size > 1:
            llm.engine.runner.backend = args.backend
        compressions = llm.engine.stats.num_compressions

        def workload():
            prompts = PROMPTS[:args.num_prompts]
            return (greedy_tokens(llm, prompts, args.max_tokens),  # noqa: B023
                    greedy_tokens(llm, prompts, args.max_tokens, args.kv_budget))  # noqa: B023

        tokens[size] = workload()
        report[f"compressions_tp{size}"] = llm.engine.stats.num_compressions - compressions
        if recorder is not None:
            report["compiles_in_steady_state"] = count_compiles(workload)
            report["shardings"] = shardings(llm)
            report["num_kv_heads"] = llm.engine.runner.model_config.num_kv_heads  # after any repetition
            report["num_layers"] = llm.engine.loaded.config.num_layers
            report["collectives"] = recorder.collectives()
        del llm
    report["tokens"] = {str(size): list(t) for size, t in tokens.items()}
    report["full_identical"] = tokens[1][0] == tokens[args.tp][0]
    report["compressed_identical"] = tokens[1][1] == tokens[args.tp][1]
    report["compressed_differs_from_full"] = tokens[1][0] != tokens[1][1]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
