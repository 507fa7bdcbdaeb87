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
    got = configs.parse_configs(["streaming@64", "zipage@128", "vnorm-prompt@auto", "vnorm-prompt@auto+keep_prompt",
                                 "vnorm-prompt@auto+no_keep_prompt"])
    assert [(c.policy, c.budget, c.keep_prompt) for c in got] == [
        ("full", 0, None), ("streaming", 64, None), ("zipage", 128, None), ("vnorm-prompt", "auto", None),
        ("vnorm-prompt", "auto", True), ("vnorm-prompt", "auto", False)]
    assert [c.name for c in got[-3:]] == ["vnorm-prompt@auto", "vnorm-prompt@auto+keep_prompt",
                                          "vnorm-prompt@auto+no_keep_prompt"]
    for bad, match in (("streaming", "POLICY@BUDGET"), ("nope@64", "unknown policy"), ("zipage@-3", "POLICY@BUDGET"),
                       ("zipage@0", "positive token counts"), ("zipage@64+keep", "POLICY@BUDGET"),
                       ("zipage+keep_prompt", "POLICY@BUDGET")):
        with pytest.raises(ValueError, match=match):
            configs.parse_configs([bad])


def test_sampling_params_carry_the_budget():
    full, auto, fixed, kept, bounded = configs.parse_configs(["zipage@auto", "streaming@64", "streaming@64+keep_prompt",
                                                              "zipage@auto+no_keep_prompt"])
    assert (full.sampling_params(8).kv_budget, full.sampling_params(8).eviction_policy) == (0, None)
    assert (auto.sampling_params(8).kv_budget, auto.sampling_params(8).eviction_policy) == ("auto", "zipage")
    assert [c.sampling_params(8).keep_prompt for c in (full, auto, fixed)] == [None] * 3  # the engine's choice
    p = kept.sampling_params(8)
    assert (p.kv_budget, p.keep_prompt, p.temperature, p.max_tokens) == (64, True, 0.0, 8)
    assert bounded.sampling_params(8).keep_prompt is False
    assert [c.keep_prompt for c in configs.configs(["zipage"], [64, "auto"], keep_prompt=True)] == [None, True, True]
    assert [c.keep_prompt for c in configs.configs(["zipage"], ["auto"], keep_prompt=False)] == [None, False]
