"""The figures of `zipage-jax bench startup`'s runs: percentiles, medians over runs, what a
server's /metrics says about its warm-up grid, and the summary of concurrent streams."""

from __future__ import annotations

import math
import statistics


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linearly interpolated; None when empty."""
    data = sorted(float(v) for v in values if v is not None)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value}, the samples of one name summed over
    their labels. Comments and lines that do not parse are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if "{" in line:
                name, rest = line[:line.index("{")], line[line.rindex("}") + 1:].split()
            else:
                name, *rest = line.split()
            value = float(rest[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def metric(metrics: dict[str, float] | None, name: str) -> float | None:
    """A metric by name, a counter with or without its _total suffix; None when absent."""
    if not metrics:
        return None
    for candidate in (name, name + "_total", name.removesuffix("_total")):
        if candidate in metrics:
            return metrics[candidate]
    return None


def grid_done(metrics: dict[str, float] | None) -> bool | None:
    """Whether the server's warm-up grid is built: zipage:warmup_done, else warmup_programs_ready
    (or programs_ready) >= warmup_programs_total; None when the metrics cannot tell (absent, or a
    grid of 0 programs: no warm-up)."""
    total = metric(metrics, "zipage:warmup_programs_total")
    if total is None or total <= 0:
        return None
    done = metric(metrics, "zipage:warmup_done")
    if done is not None:
        return done >= 1
    ready = metric(metrics, "zipage:warmup_programs_ready")
    if ready is None:
        ready = metric(metrics, "zipage:programs_ready")
    return None if ready is None else ready >= total


SERVER_METRICS = ("zipage:compile_seconds_total", "zipage:programs_ready", "zipage:programs_loaded_total",
                  "zipage:warmup_programs_total", "zipage:warmup_programs_ready", "zipage:warmup_programs_failed",
                  "zipage:warmup_serving_ready", "zipage:warmup_done")


def server_metric_snapshot(metrics: dict[str, float] | None) -> dict[str, float | None]:
    """The start-up metrics of a /metrics scrape (None for each one the server does not have)."""
    return {name: metric(metrics, name) for name in SERVER_METRICS}


def median_fields(runs: list[dict]) -> dict:
    """The median of every numeric top-level field over the successful runs (bools excluded)."""
    ok = [r for r in runs if r.get("ok")]
    names = {k for r in ok for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out = {}
    for name in sorted(names):
        values = [r[name] for r in ok if isinstance(r.get(name), int | float) and not isinstance(r[name], bool)]
        if values:
            out[name] = statistics.median(values)
    return out


def stream_summary(streams: list[dict]) -> dict:
    """TTFT percentiles and success counts of the concurrent streams."""
    ttfts = [s["ttft_s"] for s in streams if s.get("ok")]
    errors = sorted({s["error"] for s in streams if s.get("error")})
    return {"streams": len(streams), "succeeded": sum(bool(s.get("ok")) for s in streams),
            "all_succeeded": bool(streams) and all(s.get("ok") for s in streams),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "ttft_max_s": max(ttfts) if ttfts else None,
            "stream_seconds_p50": percentile([s.get("seconds") for s in streams if s.get("ok")], 50),
            "errors": errors[:5]}

