"""`zipage-jax bench data-parallel --quick` on the tiny qwen3 model: two replicas on Ray, cache-aware
routing against round robin, a replica killed mid-workload, outputs against one engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # three pairs of replicas on Ray: about a minute


def test_quick_run_meets_the_routing_fault_and_equality_goals(tiny_model_factory, model_cache_dir, tmp_path):
    """In a process of its own: Ray's threads write to the standard streams pytest swaps per test."""
    pytest.importorskip("ray")
    out = tmp_path / "result.json"
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(model_cache_dir), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "zipage_jax", "bench", "data-parallel", "--quick", "--model",
                           str(tiny_model_factory("qwen3")), "--json", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["errors"] == []
    ca, rr, fault = result["cache_aware"], result["round_robin"], result["fault"]
    # 2 prefixes x 4 requests of 4 blocks each: cache_aware computes each prefix once, round robin on both replicas
    assert ca["prefix_cache_queries"] == rr["prefix_cache_queries"] == 2 * 4 * 4
    assert ca["prefix_cache_hit_rate"] == pytest.approx(3 / 4) and rr["prefix_cache_hit_rate"] < 3 / 4
    assert ca["all_succeeded"] and rr["all_succeeded"]
    assert fault["killed"] and fault["succeeded"] == fault["requests"] == 8 and fault["replica_back_s"] > 0
    goals = result["goals"]
    for name in ("hit_rate_cache_aware_over_round_robin", "requests_through_a_replica_death",
                 "outputs_equal_one_engine"):
        assert goals[name]["met"] is True, (name, goals[name])
    throughput = goals["throughput_cache_aware_over_round_robin"]  # timing: reported, not asserted here
    assert throughput["value"] > 0 and throughput["goal"] == ">= 0.95"
