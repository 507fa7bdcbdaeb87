"""The start-up goals of `zipage-jax bench startup`: each goal's limit, where its value comes
from in the results, and whether each tree meets it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Goal:
    name: str
    limit: float  # seconds; met when value <= limit
    section: str
    phase: str  # "cold" (the one cold run) or "warm" (the median of the warm runs)
    field: str
    what: str
    require: str | None = None  # a run field that must be true as well


GOALS = (
    Goal("cold_start_to_warmed_engine_s", 90.0, "warmup", "cold", "ready_at_s",
         "process start -> LLM(model, warmup=True) returned, empty program cache"),
    Goal("cold_start_to_warmed_server_s", 90.0, "server", "cold", "grid_done_s",
         "server process start -> the whole warm-up grid built, empty program cache (baseline: /health 200 "
         "under --warmup)"),
    Goal("restart_to_first_token_s", 5.0, "first_token", "warm", "first_token_at_s",
         "process start -> first streamed token, program cache filled by an earlier process (median)"),
    Goal("restart_to_warmed_engine_s", 10.0, "warmup", "warm", "ready_at_s",
         "process start -> LLM(model, warmup=True) returned, program cache filled by an earlier process (median)"),
    Goal("restart_to_warmed_server_s", 10.0, "server", "warm", "grid_done_s",
         "server process start -> the whole warm-up grid built, program cache filled by an earlier server (median; "
         "baseline: /health 200 under --warmup)"),
    Goal("new_server_ttft_p50_s", 2.0, "server", "cold", "ttft_p50_s",
         "TTFT p50 of the concurrent new streams sent the moment a cold-started server answers /health 200 "
         "(every stream must succeed)", require="all_succeeded"),
)


def evaluate_goal(value: float | None, limit: float, ok: bool | None = True) -> dict:
    """{"value", "goal", "met"}: met is None without a value, else value <= limit (and `ok`)."""
    met = None if value is None else bool(value <= limit and ok is not False)
    return {"value": value, "goal": limit, "met": met}


def goal_value(results: dict, goal: Goal, tree: str) -> tuple[float | None, bool | None]:
    """(value, ok) of `goal` for `tree` in the results: the cold run's field or the warm runs' median."""
    per_tree = (results.get(goal.section) or {}).get(tree) or {}
    if goal.phase == "cold":
        run = per_tree.get("cold") or {}
        if not run.get("ok"):
            return None, None
        return run.get(goal.field), (None if goal.require is None else run.get(goal.require))
    warm = per_tree.get("warm") or {}
    value = (warm.get("median") or {}).get(goal.field)
    ok = None
    if goal.require is not None:
        ok = all(run.get(goal.require) for run in warm.get("runs", []))
    return value, ok


def evaluate_goals(results: dict, trees) -> dict:
    """Every goal with its limit, what it measures and, per tree (None when not run), value and met."""
    out = {}
    for goal in GOALS:
        entry = {"goal": goal.limit, "unit": "s", "what": goal.what,
                 "from": f"{goal.section}.<tree>.{goal.phase}" + (".median" if goal.phase == "warm" else "")
                 + f".{goal.field}"}
        for tree in ("current", "baseline"):
            if tree not in trees:
                entry[tree] = None
                continue
            value, ok = goal_value(results, goal, tree)
            entry[tree] = evaluate_goal(value, goal.limit, ok)
        out[goal.name] = entry
    return out

