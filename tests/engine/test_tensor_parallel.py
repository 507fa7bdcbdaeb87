"""Tensor parallelism on a `tp` mesh of host devices, and two processes over jax.distributed.

JAX fixes its device count when it starts, so every check that needs several devices runs in a
Python of its own (tests/engine/tp_worker.py sets XLA_FLAGS=--xla_force_host_platform_device_count=4
before importing jax); this process keeps its single device. Greedy tokens must equal TP=1's
in float32, with full KV and with compression.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from zipage_jax import LLM
from zipage_jax.crosscheck.tp import first_difference
from zipage_jax.engine.sharding import check_divisible, shard_ready, tensor_parallel
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import load_model
from zipage_jax.models.weights import flat_params, split_qkv

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
SMALL_ENGINE = ["--kvcache-block-size", "16", "--num-kvcache-blocks", "64", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "64", "--compilation-cache-dir="]


@pytest.fixture(scope="module")
def cache_dir(model_cache_dir, monkeypatch_module) -> Path:
    monkeypatch_module.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    return model_cache_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def model_6_2(tiny_model_factory) -> Path:
    """6 query / 2 kv heads (head_dim 16) with q/k/v biases: splits over 2 devices."""
    return tiny_model_factory("qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)


def _env(cache_dir: Path) -> dict:
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(cache_dir), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return env


def _run(args: list[str], cache_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(cache_dir), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_worker(model, tp: int, cache_dir: Path, *extra: str, timeout: float = 900) -> dict:
    proc = _run([str(WORKER), str(model), str(tp), *extra], cache_dir, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp2(model_6_2, cache_dir) -> dict:
    return run_worker(model_6_2, 2, cache_dir)


# -- TP=2 on 6 query / 2 kv heads ------------------------------------------------------------


def test_tp2_greedy_tokens_equal_tp1_full_and_compressed(tp2):
    assert tp2["devices"] == 4
    assert tp2["full_identical"], tp2["tokens"]
    assert tp2["compressed_identical"], tp2["tokens"]
    assert tp2["compressions_tp1"] > 0 and tp2["compressions_tp2"] == tp2["compressions_tp1"]
    assert tp2["compressed_differs_from_full"]  # the budget really changed what the model saw
    full, compressed = tp2["tokens"]["2"]
    assert [len(t) for t in full] == [len(t) for t in compressed] == [100] * 4


def test_tp2_weights_split_megatron_style_and_pool_split_on_heads(tp2):
    s = tp2["shardings"]
    E, D = 96, 16
    expected = {  # name: (spec, per-device shard shape)
        "layers.0.self_attn.qkv_proj.kernel": ([None, "tp"], [E, (3 + 2) * D]),  # 3 query heads, 1 k, 1 v
        "layers.0.self_attn.qkv_proj.bias": (["tp"], [(3 + 2) * D]),
        "layers.0.self_attn.o_proj.kernel": (["tp", None], [3 * D, E]),
        "layers.0.mlp.gate_proj.kernel": ([None, "tp"], [E, 64]),
        "layers.0.mlp.up_proj.kernel": ([None, "tp"], [E, 64]),
        "layers.0.mlp.down_proj.kernel": (["tp", None], [64, E]),
        "layers.0.input_layernorm.weight": ([], [E]),
        "embed_tokens.weight": ([], [320, E]),
        "kv.k[0]": ([None, None, "tp"], [64, 16, 1, D]),
        "kv.v[0]": ([None, None, "tp"], [64, 16, 1, D]),
        "kv.queries[0]": ([None, None, "tp"], [9, 16, 3, D]),
    }
    for name, (spec, shard_shape) in expected.items():
        assert (s[name]["spec"], s[name]["shard_shape"], s[name]["devices"]) == (spec, shard_shape, 2), name


def assert_two_all_reduces_per_layer(report: dict) -> None:
    """Every compiled decode and prefill program of a layer group: 2 all-reduces per layer, no
    other collective; the embed and head programs: none."""
    for stage in ("embed", "layers", "head"):
        programs = report["collectives"][stage]
        assert {key.split()[0] for key in programs} == {"decode", "prefill"}, (stage, programs)
        for key, ops in programs.items():
            if stage != "layers":
                assert ops == {}, (stage, key, ops)
                continue
            assert list(ops) == ["all-reduce"] and len(ops["all-reduce"]) == 2 * report["layers_per_group"], (key, ops)


def assert_compression_has_no_collective(report: dict) -> None:
    compression = report["collectives"]["compression"]
    assert compression and all(ops == {} for ops in compression.values()), compression


def test_tp2_only_collectives_are_two_all_reduces_per_layer_and_compression_has_none(tp2):
    assert_two_all_reduces_per_layer(tp2)  # the replicated sampler state adds no collective
    for ops in tp2["collectives"]["layers"].values():  # [B, C, E]: after o_proj and after down_proj
        assert all(shape.endswith(",96]") for shape in ops["all-reduce"]), ops
    assert_compression_has_no_collective(tp2)  # no all-gather of the pool: every shard works alone


def test_tp2_sampler_state_stays_replicated(tp2):
    for name in ("last_token", "output_counts", "prompt_mask"):
        entry = tp2["shardings"][f"sampler.{name}"]
        assert (entry["spec"], entry["shard_shape"], entry["devices"]) == ([], entry["shape"], 2), name


def test_tp2_steady_workload_never_recompiles(tp2):
    assert tp2["compiles_in_steady_state"] == 0 and tp2["programs_added_in_steady_state"] == 0
    assert tp2["repeat_identical"]


# -- TP=2 with quantized pools ----------------------------------------------------------------


@pytest.fixture(scope="module")
def model_d64(tiny_model_factory) -> Path:
    """qwen3, 4 query / 2 kv heads of head_dim 64: an int4 pool packs 32 bytes and 2 scales per token and head."""
    return tiny_model_factory("qwen3", head_dim=64)


def check_quantized_report(report: dict, kv_cache_dtype: str = "int8", head_dim: int = 16) -> None:
    """A quantized pool under TP: tokens equal one device's tokens at that dtype, with full KV and
    compressed, and a second run's; the scales are split on kv heads like the pool (int8:
    [NB, BS, Hkv] float32; int4: packed [.., D / 2] uint8, scales [NB, BS, Hkv, D / 32] float16)."""
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["repeat_identical"] and report["compiles_in_steady_state"] == 0
    assert report["compressions_tp2"] == report["compressions_tp1"] > 0
    s = report["shardings"]
    int4 = kv_cache_dtype == "int4"
    pool = ("uint8", [64, 16, 1, head_dim // 2]) if int4 else ("int8", [64, 16, 1, head_dim])
    scales = ("float16", [64, 16, 1, head_dim // 32]) if int4 else ("float32", [64, 16, 1])
    assert (s["kv.k[0]"]["dtype"], s["kv.k[0]"]["shard_shape"]) == pool
    for name in ("kv.k_scales[0]", "kv.v_scales[0]"):
        entry = s[name]
        assert (entry["spec"], entry["shard_shape"], entry["devices"], entry["dtype"]) == \
            ([None, None, "tp"], scales[1], 2, scales[0]), name
    assert_two_all_reduces_per_layer(report)
    assert_compression_has_no_collective(report)


@pytest.mark.slow
def test_tp2_int8_pool_equals_tp1_int8_full_and_compressed(model_6_2, cache_dir):
    # Scales are per token per kv head, computed where the head lives: TP quantizes as one device does.
    check_quantized_report(run_worker(model_6_2, 2, cache_dir, "--kv-cache-dtype", "int8", "--max-tokens", "60",
                                      "--num-prompts", "2"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "pallas-interpret"])
def test_tp2_int4_pool_equals_tp1_int4_full_and_compressed(model_d64, cache_dir, backend):
    # Group scales [NB, BS, Hkv, D / 32] split on kv heads with the packed pool, through the decode
    # kernel's shard_map too (pallas-interpret).
    check_quantized_report(run_worker(model_d64, 2, cache_dir, "--backend", backend, "--kv-cache-dtype", "int4",
                                      "--max-tokens", "60", "--num-prompts", "2"), "int4", head_dim=64)


# -- sizes, devices, kv head repetition (this process, one device) -----------------------------


def _config(num_heads: int, num_kv_heads: int, intermediate: int = 384) -> ModelConfig:
    return ModelConfig("llama", 320, 64, intermediate, 2, num_heads, num_kv_heads, 16, 1e-6, 1e4, None, 512, False,
                       False, False, False, 1, (2,))


def test_sizes_that_do_not_split_the_model_raise_clear_errors(model_6_2, cache_dir):
    assert check_divisible(_config(9, 3), 3) == 1
    assert check_divisible(_config(6, 2), 2) == 1
    assert check_divisible(_config(4, 2), 4) == 2  # fewer kv heads than devices: each repeated twice
    assert check_divisible(_config(8, 1), 4) == 4
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(9\); try one of \[1, 3, 9\]"):
        check_divisible(_config(9, 3), 2)
    with pytest.raises(ValueError, match="2 kv heads must divide one another"):
        check_divisible(_config(6, 2), 3)
    with pytest.raises(ValueError, match=r"MLP intermediate size \(99\)"):
        check_divisible(_config(6, 2, intermediate=99), 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the number of attention heads \(6\)"):
        LLM(str(model_6_2), tensor_parallel_size=4, compilation_cache_dir="")


def test_more_devices_than_jax_sees_raise():
    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size {n} needs {n} devices, but JAX sees {n - 1}"):
        tensor_parallel(n)
    assert tensor_parallel(1) is None


def test_kv_heads_repeated_next_to_their_query_heads(tiny_model_factory, cache_dir):
    loaded = load_model(str(tiny_model_factory("llama")), dtype="float32")  # 4 query / 2 kv heads, D 16
    assert shard_ready(loaded, 2) is loaded
    repeated = shard_ready(loaded, 4)
    assert (loaded.config.num_kv_heads, repeated.config.num_kv_heads) == (2, 4)
    before, after = flat_params(loaded.model), flat_params(repeated.model)
    for layer in range(loaded.config.num_layers):
        name = f"layers.{layer}.self_attn.qkv_proj.kernel"
        q, k, v = split_qkv(before[name], 4, 2)
        q_after, k_after, v_after = split_qkv(after[name], 4, 4)
        for a, a_after in ((k, k_after), (v, v_after)):
            heads = np.asarray(a).reshape(64, 2, 16)
            np.testing.assert_array_equal(np.asarray(a_after).reshape(64, 4, 16), heads[:, [0, 0, 1, 1]])
        np.testing.assert_array_equal(q_after, q)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# -- the crosscheck command (re-executes itself with enough host devices) ---------------------


def test_crosscheck_tp2_restarts_itself_with_enough_devices(model_6_2, cache_dir):
    proc = _run(["-m", "zipage_jax.crosscheck", "tp", "--model", str(model_6_2), "--tp", "2", "--json",
                 "--prompt", "Hello there", "--max-tokens", "8", *SMALL_ENGINE], cache_dir, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["identical"] and report["tokens_compared"] == 8 and len(report["devices"]) == 2


# -- heavier cases --------------------------------------------------------------------------


@pytest.mark.slow
def test_tp4_with_repeated_kv_heads_equals_tp1(tiny_model_factory, cache_dir):
    model = tiny_model_factory("llama")  # 4 query / 2 kv heads, D 16: each kv head on two devices
    report = run_worker(model, 4, cache_dir, "--max-tokens", "60")
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["compressions_tp4"] > 0 and report["compiles_in_steady_state"] == 0
    assert report["num_kv_heads"] == 4
    assert report["shardings"]["kv.k[0]"]["shard_shape"] == [64, 16, 1, 16]
    assert report["shardings"]["layers.0.self_attn.qkv_proj.kernel"]["shard_shape"] == [64, (1 + 2) * 16]
    assert_two_all_reduces_per_layer(report)
    # Compression gathers only the query group of the sequences it compresses ([B, QL, Hq, D]).
    assert report["collectives"]["compression"]
    for gathers in report["collectives"]["compression"].values():
        assert list(gathers) == ["all-gather"] and len(gathers["all-gather"]) == 1  # one program per layer
        assert all(re.fullmatch(r"f32\[\d+,16,4,16\]", shape) for shape in gathers["all-gather"]), gathers


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(cache_dir):
    report = run_worker("default", 3, cache_dir, "--max-tokens", "40", "--num-prompts", "2", timeout=1800)
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["compressions_tp3"] > 0 and report["compiles_in_steady_state"] == 0
    assert report["shardings"]["kv.k[0]"]["shard_shape"][2] == 1  # 3 kv heads, one per device
    assert_two_all_reduces_per_layer(report)
    assert_compression_has_no_collective(report)


@pytest.mark.slow
def test_pallas_kernels_under_shard_map_interpreted(model_6_2, cache_dir):
    report = run_worker(model_6_2, 2, cache_dir, "--backend", "pallas-interpret", "--max-tokens", "40",
                        "--num-prompts", "2")
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["repeat_identical"] and report["compressions_tp2"] > 0
    assert_two_all_reduces_per_layer(report)
    assert_compression_has_no_collective(report)


@pytest.mark.slow
def test_pallas_kernels_under_shard_map_interpreted_int8_pool(model_6_2, cache_dir):
    # The decode kernel's k_scales / v_scales go through shard_map split on kv heads, like the pools.
    check_quantized_report(run_worker(model_6_2, 2, cache_dir, "--backend", "pallas-interpret", "--kv-cache-dtype",
                                      "int8", "--max-tokens", "60", "--num-prompts", "2"))


# -- two processes over jax.distributed (gloo collectives on CPU) -----------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generated(stdout: str) -> list[str]:
    return [json.loads(line)["text"] for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_two_processes_match_one(model_6_2, cache_dir, tmp_path):
    cli = ["-m", "zipage_jax", "generate", "Hello there", "The capital of", "--model", str(model_6_2),
           "--max-tokens", "16", "--json", *SMALL_ENGINE]
    single = _run(cli, cache_dir, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    address = f"127.0.0.1:{_free_port()}"
    empty_cache = tmp_path / "cache"  # a group converts the weights itself and caches nothing
    procs = [subprocess.Popen([sys.executable, *cli, "--tensor-parallel-size", "2", "--coordinator-address",
                               address, "--num-processes", "2", "--process-id", str(i)], env=_env(empty_cache),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    expected = _generated(single.stdout)
    assert len(expected) == 2
    assert [_generated(out) for out, _ in outs] == [expected, expected]
    assert not list(empty_cache.rglob("hf_config.json"))
