"""`bench soak`'s judgement, pure functions over what the run recorded: whether an answer's body
holds what its kind promises, each request's outcome, the report and its goals, and the table.

Outcomes: "ok" (the 2xx it deserved, its body as promised), "refused" (a bad request's 4xx, the
code it deserved), "disconnected" (a stream the client dropped on purpose), "excused" (see
below) and "unexpected" (anything else: a status it did not deserve, a body that breaks its
promise, a stream that ends in an error event or without [DONE], a transport error or timeout).

The replica-kill rule: a replica that dies has its requests run again on another one, except a
request that samples without a seed and had already produced tokens (it cannot run again unseen,
data_parallel/replicated_engine.py). Such a request fails: a 500, or a stream's error event. A
failure is "excused" when the request was of that sort (not replayable) and in flight when the
replica was killed (sent before, ended after); every other failure is unexpected.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from zipage_jax.bench.soak_mix import TOOLS

RSS_GROWTH_BOUND = 0.05
P99_RATIO_BOUND = 1.5
STREAM_ERROR = "the stream ended with an error event"
OUTCOMES = ("ok", "refused", "disconnected", "excused", "unexpected")
_SHOWN_UNEXPECTED = 50  # at most this many unexpected requests are listed in the report


@dataclass
class Record:
    """One request as the client saw it; times in seconds since the measured run's start (the
    warm-up's are negative)."""

    kind: str
    phase: str  # "warmup" or "run"
    stream: bool
    expect: int
    replayable: bool
    sent: float
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer (connection error, timeout)
    problem: str | None = None  # what was wrong with the answer, if anything
    disconnected: bool = False
    greedy_case: int | None = None
    tokens: list[str] | None = field(default=None, repr=False)  # a greedy answer's tokens


def body_problem(kind: str, body: dict, n: int) -> str | None:
    """What a whole 200 answer of `kind` lacks, or None."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        return f"expected {n} choices, got {len(choices) if isinstance(choices, list) else choices!r}"
    usage = body.get("usage") or {}
    for choice in choices:
        finished = choice.get("finish_reason") != "length"
        message = choice.get("message") or {}
        if kind == "structured" and finished:
            try:
                answer = json.loads(message.get("content") or "")
            except json.JSONDecodeError:
                return f"structured output is not JSON: {message.get('content')!r:.200}"
            if not isinstance(answer, dict) or not {"answer", "score"} <= answer.keys():
                return f"structured output misses its schema's keys: {answer!r:.200}"
        if kind == "tools" and finished:
            problem = _tool_calls_problem(message.get("tool_calls"))
            if problem:
                return problem
        if kind == "logprobs":
            logprobs = choice.get("logprobs") or {}
            entries = logprobs.get("tokens", logprobs.get("content"))
            if not isinstance(entries, list) or len(entries) != usage.get("completion_tokens"):
                return f"{len(entries or [])} logprobs entries for {usage.get('completion_tokens')} tokens"
    return None


def _tool_calls_problem(calls: object) -> str | None:
    names = {t["function"]["name"] for t in TOOLS}
    if not isinstance(calls, list) or not calls:
        return f"a finished tool_choice answer has no tool_calls: {calls!r:.200}"
    for call in calls:
        function = call.get("function") or {}
        if function.get("name") not in names:
            return f"a tool call names no tool: {function.get('name')!r:.100}"
        try:
            if not isinstance(json.loads(function.get("arguments") or ""), dict):
                return "a tool call's arguments are not a JSON object"
        except json.JSONDecodeError:
            return f"a tool call's arguments are not JSON: {function.get('arguments')!r:.200}"
    return None


def outcome(record: Record, kill_at: float | None) -> str:
    """The record's outcome (see the module's docstring); `kill_at`: when a replica was killed."""
    if record.status == record.expect and record.problem is None:
        if record.disconnected:
            return "disconnected"
        return "ok" if record.expect < 300 else "refused"
    failed = record.status == 500 or (record.status == 200 and record.problem == STREAM_ERROR)
    in_flight = kill_at is not None and record.sent <= kill_at <= record.ended
    if failed and in_flight and not record.replayable:
        return "excused"
    return "unexpected"


def greedy_report(records: list[Record], expected: list[list[str]]) -> dict:
    """Each greedy answer against the offline engine's tokens of its case."""
    answers = [r for r in records if r.greedy_case is not None and r.tokens is not None]
    mismatches = [{"case": r.greedy_case, "sent": round(r.sent, 2), "server": r.tokens,
                   "offline": expected[r.greedy_case]} for r in answers if r.tokens != expected[r.greedy_case]]
    cases = sorted({r.greedy_case for r in answers})
    return {"cases": len(expected), "cases_answered": len(cases), "answers": len(answers),
            "mismatches": len(mismatches), "first_mismatches": mismatches[:5]}


def latency_tenths(records: list[Record], duration: float) -> dict:
    """p50 / p99 seconds of the whole (not streamed) requests answered as deserved, sent in the
    run's first and last tenth."""
    def stats(low: float, high: float) -> dict:
        times = [r.ended - r.sent for r in records if r.phase == "run" and not r.stream and r.expect == 200
                 and r.status == 200 and r.problem is None and low <= r.sent < high]
        if not times:
            return {"requests": 0, "p50_s": None, "p99_s": None}
        p50, p99 = np.percentile(times, [50, 99])
        return {"requests": len(times), "p50_s": round(float(p50), 4), "p99_s": round(float(p99), 4)}

    return {"first_tenth": stats(0.0, duration / 10), "last_tenth": stats(duration * 0.9, duration)}


def soak_report(records: list[Record], expected: list[list[str]], duration: float, kill_at: float | None,
                blocks: dict, rss: dict) -> dict:
    """The result's figures and goals. `blocks`: {"start", "end"} free KV blocks at idle after the
    warm-up and at the end; `rss`: {"after_warmup", "end"} bytes of the server's process tree."""
    outcomes = [outcome(r, kill_at) for r in records]
    by_kind: dict[str, Counter] = {}
    for r, o in zip(records, outcomes):
        by_kind.setdefault(r.kind, Counter())[o] += 1
    unexpected = [{"kind": r.kind, "phase": r.phase, "sent": round(r.sent, 2), "status": r.status,
                   "problem": r.problem} for r, o in zip(records, outcomes) if o == "unexpected"]
    leaked = None if None in (blocks.get("start"), blocks.get("end")) else blocks["start"] - blocks["end"]
    growth = (rss["end"] / rss["after_warmup"] - 1) if rss.get("after_warmup") and rss.get("end") else None
    latency = latency_tenths(records, duration)
    first, last = latency["first_tenth"]["p99_s"], latency["last_tenth"]["p99_s"]
    ratio = last / first if first and last is not None else None
    greedy = greedy_report(records, expected)
    report = {
        "requests": {kind: {o: counts[o] for o in OUTCOMES} for kind, counts in sorted(by_kind.items())},
        "totals": {o: outcomes.count(o) for o in OUTCOMES},
        "unexpected": len(unexpected), "first_unexpected": unexpected[:_SHOWN_UNEXPECTED],
        "greedy": greedy,
        "kv_free_blocks": {**blocks, "leaked": leaked},
        "rss_bytes": {**rss, "growth": None if growth is None else round(growth, 4)},
        "latency": {**latency, "p99_last_over_first": None if ratio is None else round(ratio, 3)},
    }
    greedy_ok = greedy["cases_answered"] == greedy["cases"] and greedy["mismatches"] == 0
    report["goals"] = {
        "no_unexpected_errors": _goal(len(unexpected), "== 0", len(unexpected) == 0),
        "greedy_identical": _goal(greedy["mismatches"], f"== 0 (and all {greedy['cases']} cases answered)",
                                  greedy_ok),
        "no_leaked_blocks": _goal(leaked, "== 0", leaked == 0),
        "rss_growth": _goal(report["rss_bytes"]["growth"], f"<= {RSS_GROWTH_BOUND}",
                            growth is not None and growth <= RSS_GROWTH_BOUND),
        "p99_last_over_first_tenth": _goal(report["latency"]["p99_last_over_first"], f"<= {P99_RATIO_BOUND}",
                                           ratio is not None and ratio <= P99_RATIO_BOUND),
    }
    return report


def _goal(value, bound: str, met: bool) -> dict:
    return {"value": value, "bound": bound, "met": bool(met)}


def all_met(report: dict) -> bool:
    return all(goal["met"] for goal in report["goals"].values())


def table(report: dict) -> str:
    """Requests by kind and outcome, then each goal: the short form of the report."""
    width = max(map(len, report["requests"]), default=4) + 2
    lines = ["kind".ljust(width) + "".join(o.rjust(13) for o in OUTCOMES)]
    for kind, counts in report["requests"].items():
        lines.append(kind.ljust(width) + "".join(str(counts[o]).rjust(13) for o in OUTCOMES))
    lines.append("total".ljust(width) + "".join(str(report["totals"][o]).rjust(13) for o in OUTCOMES))
    for name, goal in report["goals"].items():
        lines.append(f"goal {name}: {goal['value']} ({goal['bound']}) {'met' if goal['met'] else 'MISSED'}")
    return "\n".join(lines)
