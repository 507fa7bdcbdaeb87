"""Engines stepped side by side on one machine: the warm-up before timing, a run's common state,
and `drive`, which steps several runs in turns so that all of them see the same load."""

from __future__ import annotations

import sys
import time

TURN_STEPS = 16  # steps an interleaved run takes before the next run's turn


def warm_up(engine, warmup: bool = True) -> dict:
    """Compiles every program the engine can reach (untimed); returns what it took."""
    start = time.perf_counter()
    compiled = engine.warmup(progress=False) if warmup else 0
    return {"warmup_seconds": time.perf_counter() - start, "warmup_programs_compiled": compiled}


class EngineRun:
    """An engine with its requests added, stepped by `drive` (the run with fewer tokens first)."""

    def __init__(self, name: str, engine):
        self.name, self.engine = name, engine
        self.compiles_at_start = engine.get_stats().num_compiles  # stats.num_compiles is refreshed by step()

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def generated(self) -> int:
        return self.engine.stats.generation_tokens

    @property
    def num_compiles(self) -> int:
        """Programs compiled since the run started (after the warm-up)."""
        return self.engine.get_stats().num_compiles - self.compiles_at_start

    def wait_for_device(self) -> float:
        """Blocks until the engine's dispatched work is done; returns the seconds waited."""
        start = time.perf_counter()
        self.engine.wait_for_device()
        return time.perf_counter() - start


def drive(runs: list, interleave: bool, turn_steps: int = TURN_STEPS) -> None:
    """Steps the runs to completion: one after the other, or interleaved, in turns of
    `turn_steps` steps, the run with the fewest tokens so far taking the next turn (all finish
    together and see the same machine load). A turn ends by waiting for the run's dispatched
    work (`end_turn`, counted in its time): with asynchronous scheduling, an engine's last step
    would otherwise run on the device during the next engine's turn and be timed there."""
    while pending := [r for r in runs if not r.done]:
        run = min(pending, key=lambda r: r.generated) if interleave else pending[0]
        for _ in range(turn_steps if interleave else sys.maxsize):
            run.step()
            if run.done:
                break
        run.end_turn()
