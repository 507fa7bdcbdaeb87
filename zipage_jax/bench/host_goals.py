"""The goals of `bench host`, checked on one run's figures, and what they imply for a GPU."""

from __future__ import annotations

import numpy as np

GPU_STEP_MS = 5.0  # a decode step of a 1-2B model at a few hundred rows on an H200


def _goal(value: float | None, bound: str, met: bool) -> dict:
    return {"value": None if value is None else round(value, 3), "bound": bound, "met": value is not None and met}


def evaluate_goals(result: dict) -> dict:
    """Each goal's value, its bound and whether it is met (a batch or section the run did not
    measure leaves its goal unmet, value None)."""
    rows = result["batches"]
    base = min(rows, key=int) if rows else None

    def host(batch: str, engine: str = "full") -> float | None:
        return rows[batch][engine]["host_ms"] if batch in rows else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    step_over_bare = rows["256"]["full"]["step_over_bare"] if "256" in rows else None
    host_256 = ratio(host("256"), host(base)) if base == "16" else None
    host_1024 = ratio(host("1024"), host(base)) if base == "16" else None
    compressed = rows["256"]["compressed_over_full_host"] if "256" in rows else None
    server = result.get("server", {}).get("server_over_offline")
    goals = {
        "step_over_bare_256_full": _goal(step_over_bare, "<= 1.5", (step_over_bare or 0) <= 1.5),
        "host_256_over_16_full": _goal(host_256, "<= 2", (host_256 or 0) <= 2),
        "host_1024_over_16_full": _goal(host_1024, "<= 4", (host_1024 or 0) <= 4),
        "compressed_over_full_host_256": _goal(compressed, "<= 1.2", (compressed or 0) <= 1.2),
        "server_over_offline_tok_s": _goal(server, ">= 0.9", (server or 0) >= 0.9),
    }
    result["gpu_implication"] = {engine: batch_at_host_ms(rows, engine, GPU_STEP_MS)
                                 for engine in ("full", "compressed")}
    return goals


def batch_at_host_ms(rows: dict, engine: str, host_ms: float) -> int | None:
    """The batch at which the host's time per step reaches `host_ms`, from a least-squares line
    through the measured (batch, host ms) points; None when it never does (the line does not rise)."""
    if len(rows) < 2:
        return None
    batches = np.array([int(b) for b in rows], float)
    hosts = np.array([rows[b][engine]["host_ms"] for b in rows], float)
    slope, intercept = np.polyfit(batches, hosts, 1)
    if slope <= 0:
        return None
    return max(0, int((host_ms - intercept) / slope))
