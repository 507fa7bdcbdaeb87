"""The inter-token latency of k tokens that arrive together is k observations of their mean gap,
recorded in one update: the exposition must equal observing them one by one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zipage_jax.server.metrics import observe_times


def samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}


def test_observing_k_times_at_once_equals_k_observations():
    got = []
    for batched in (False, True):
        registry = CollectorRegistry()
        h = Histogram("itl_seconds", "x", ["model_name"], buckets=(0.01, 0.1, 1.0), registry=registry).labels("m")
        for value, times in ((0.005, 3), (0.05, 1), (0.5, 4), (7.0, 2), (0.1, 5)):
            if batched:
                observe_times(h, value, times)
            else:
                for _ in range(times):
                    h.observe(value)
        got.append(samples(registry))
    one_by_one, at_once = got
    assert one_by_one.keys() == at_once.keys() and len(one_by_one) == 6  # 4 buckets, count, sum
    assert all(at_once[k] == pytest.approx(v) for k, v in one_by_one.items())
    assert one_by_one[("itl_seconds_count", (("model_name", "m"),))] == 15
