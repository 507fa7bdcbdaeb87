"""The configs a task evaluation compares, and its per-split table (zipage_jax/evals/configs.py)."""

from __future__ import annotations

import pytest

from zipage_jax.evals import configs


def test_configs_are_validated():
    assert [c.name for c in configs.configs(["zipage"], [64, 128, "auto"])] == [
        "full", "zipage@64", "zipage@128", "zipage@auto"]
    with pytest.raises(ValueError, match="unknown policy"):
        configs.configs(["nope"], [64])
    with pytest.raises(ValueError, match="positive token counts"):
        configs.configs(["zipage"], [0])
    with pytest.raises(ValueError, match="positive token counts"):
        configs.configs(["zipage"], ["automatic"])


def test_config_pairs_are_parsed_and_validated():
    got = configs.parse_configs(["streaming@64", "zipage@128", "vnorm-prompt@auto"])
    assert [(c.policy, c.budget) for c in got] == [("full", 0), ("streaming", 64), ("zipage", 128),
                                                   ("vnorm-prompt", "auto")]
    for bad, match in (("streaming", "POLICY@BUDGET"), ("nope@64", "unknown policy"), ("zipage@-3", "POLICY@BUDGET"),
                       ("zipage@0", "positive token counts")):
        with pytest.raises(ValueError, match=match):
            configs.parse_configs([bad])


def test_sampling_params_carry_the_budget():
    full, auto, fixed = configs.parse_configs(["zipage@auto", "streaming@64"])
    assert (full.sampling_params(8).kv_budget, full.sampling_params(8).eviction_policy) == (0, None)
    assert (auto.sampling_params(8).kv_budget, auto.sampling_params(8).eviction_policy) == ("auto", "zipage")
    p = fixed.sampling_params(8, keep_prompt=True)
    assert (p.kv_budget, p.keep_prompt, p.temperature, p.max_tokens) == (64, True, 0.0, 8)
    assert not full.sampling_params(8, keep_prompt=True).keep_prompt
