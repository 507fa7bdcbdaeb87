"""Expert parallelism (`enable_expert_parallel`): a mixture of experts split over the `tp` mesh by
expert. The expert MLP alone and whole engines run over 4 host devices in Pythons of their own
(tests/model/expert_parallel_worker.py, tests/engine/tp_worker.py); the refusals run here."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P
from tiny_models import MOE_ARCHS

from zipage_jax import LLM
from zipage_jax.config import EngineConfig
from zipage_jax.engine.sharding import check_divisible, param_spec, shard_model
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
MLP_WORKER = Path(__file__).with_name("expert_parallel_worker.py")


@pytest.fixture(scope="module")
def ep_cache(model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield model_cache_dir
    mp.undo()


@pytest.mark.slow
def test_expert_parallel_mlp_equals_one_device_with_one_all_reduce(ep_cache):
    from engine.test_tensor_parallel import _env

    proc = subprocess.run([sys.executable, str(MLP_WORKER)], env=_env(ep_cache), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    for case in ("float32 tiles", "float32 ragged_dot", "bfloat16 tiles", "bfloat16 ragged_dot"):
        result = report[case]
        assert result["output_norm"] > 1.0, case  # the outputs compared are not all zero
        assert result["max_abs_diff"] == 0.0, (case, result)  # top-2: at most two non-zero terms per token
        assert result["weight_shard_shape"] == [2, 64, 32], case  # 8 experts, 2 whole ones per device
        # the devices' outputs summed once, in float32 [tokens, hidden]; no expert weight gathered
        assert result["collectives"] == [["all-reduce", "f32[37,64]"]], (case, result["collectives"])


def _config(width: int, num_experts: int = 0) -> ModelConfig:
    """12 query and kv heads; a mixture of `num_experts` experts of `width`, or (0) a dense MLP of `width`."""
    return ModelConfig("qwen3_moe" if num_experts else "qwen3", 320, 64, width, 2, 12, 12, 16, 1e-6, 1e4, None, 512,
                       False, False, False, True, 1, (2,), num_experts=num_experts,
                       num_experts_per_tok=2 if num_experts else 0, moe_intermediate_size=width if num_experts else 0)


def test_expert_count_must_divide_the_devices():
    cfg = _config(20, num_experts=6)
    assert check_divisible(cfg, 3, expert_parallel=True) == 1  # 2 whole experts each: their width is not split
    with pytest.raises(ValueError, match=r"MLP intermediate size \(20\)"):
        check_divisible(cfg, 3)  # positive control: split by width, 20 does not divide by 3
    assert check_divisible(cfg, 4) == 1
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 4 must divide the number of "
                                         r"experts \(6\); try one of \[1, 2, 3, 6\]"):
        check_divisible(cfg, 4, expert_parallel=True)


def test_engine_refuses_experts_that_do_not_split(tiny_model_factory, ep_cache):
    path = str(tiny_model_factory("qwen3_moe", num_experts=6))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide the number of experts \(6\)"):
        LLM(path, tensor_parallel_size=4, enable_expert_parallel=True, compilation_cache_dir="")


def test_flag_must_be_a_bool():
    assert EngineConfig.from_options(enable_expert_parallel=True).enable_expert_parallel
    assert not EngineConfig().enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false, got 'yes'"):
        EngineConfig(enable_expert_parallel="yes")


def _path(*names: str) -> tuple:
    return tuple(names)


def test_experts_split_on_their_first_axis_and_dense_layers_as_under_tensor_parallelism():
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        path = _path("layers", "0", "mlp", "experts", leaf)
        assert param_spec(path, expert_parallel=True) == P("tp", None, None)
        assert param_spec(path) != P("tp", None, None)  # positive control: split on width without it
    for path in (_path("layers", "0", "mlp", "gate_proj", "kernel"), _path("layers", "0", "mlp", "down_proj", "kernel"),
                 _path("layers", "0", "mlp", "gate", "kernel"), _path("layers", "0", "self_attn", "o_proj", "kernel")):
        assert param_spec(path, expert_parallel=True) == param_spec(path), path


def test_flag_on_a_dense_model_has_no_effect(tiny_model_factory, ep_cache, caplog):
    with pytest.raises(ValueError, match=r"MLP intermediate size \(20\)"):
        check_divisible(_config(20), 3, expert_parallel=True)  # a dense MLP is split by width all the same
    loaded = load_model(str(tiny_model_factory("qwen3")), dtype="float32")
    with caplog.at_level(logging.INFO, logger="zipage_jax"):
        assert shard_model(loaded, 1, expert_parallel=True) == (loaded, None)
    assert "enable_expert_parallel has no effect: the model has no experts" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parallel_gives_one_devices_greedy_tokens(arch, tiny_model_factory, ep_cache):
    from engine.test_tensor_parallel import assert_two_all_reduces_per_layer, run_worker

    report = run_worker(tiny_model_factory(arch), 4, ep_cache, "--enable-expert-parallel", "--max-tokens", "40")
    assert report["full_identical"] and report["compressed_identical"], report["tokens"]
    assert report["compressions_tp1"] > 0 and report["compressions_tp4"] > 0
    assert report["compressed_differs_from_full"]  # the small kv_budget really changed what the model saw
    experts = {name: s for name, s in report["shardings"].items() if ".mlp.experts." in name}
    assert len(experts) == 3, experts
    for name, s in experts.items():  # each device holds E/4 whole experts
        assert (s["spec"], s["devices"]) == (["tp", None, None], 4), name
        assert s["shard_shape"] == [s["shape"][0] // 4, *s["shape"][1:]], name
    assert report["compiles_in_steady_state"] == 0 and report["programs_added_in_steady_state"] == 0
    assert report["repeat_identical"]
    assert_two_all_reduces_per_layer(report)  # after o_proj and the experts' sum: no weight gathered
