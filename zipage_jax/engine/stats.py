"""The engine's counters, as `EngineCore.get_stats()` and the periodic log line report them, and
its warm-up's progress."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_compressions: int = 0
    kv_tokens_evicted: int = 0
    seqs_at_budget: int = 0
    query_slots_in_use: int = 0
    num_query_slots: int = 0
    num_kv_blocks: int = 0
    num_free_blocks: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_recoveries: int = 0  # device-state rebuilds after a failed step
    num_compiles: int = 0  # programs built since the engine started (warm-up included): compiled or loaded
    num_programs_loaded: int = 0  # of which loaded from the executable store (neither traced nor compiled)
    compile_seconds: float = 0.0  # building them: tracing, lowering and compiling, or loading
    num_steps: int = 0
    step_seconds: float = 0.0  # wall time inside step()
    device_wait_seconds: float = 0.0  # of which waiting for the device's tokens (the rest is host work)

    def account(self, elapsed: float, num_prefill: int, num_decode: int) -> None:
        """A step's tokens reached the host, `elapsed` seconds after the one before."""
        self.prompt_tokens += num_prefill
        if num_prefill:
            self.prefill_seconds += elapsed
            self.prefill_tokens += num_prefill
        else:
            self.decode_seconds += elapsed
            self.decode_tokens += num_decode

    def log_line(self) -> str:
        return (f"running {self.num_running}, waiting {self.num_waiting}, KV usage {100 * self.kv_usage:.1f}%, "
                f"prefix-cache hit rate {100 * self.prefix_cache_hit_rate:.1f}%, "
                f"compressions {self.num_compressions}, evicted tokens {self.kv_tokens_evicted}, "
                f"at budget {self.seqs_at_budget}, query slots {self.query_slots_in_use}/{self.num_query_slots}, "
                f"preemptions {self.num_preemptions}, recoveries {self.num_recoveries}")


@dataclass(frozen=True)
class WarmupStatus:
    """A warm-up's progress (engine/runner/warmup.py)."""

    total: int  # programs in the grid
    ready: int  # built so far (compiled or loaded)
    serving_ready: bool  # the serving set is built: every step can run without compiling
    done: bool  # every program is built, failed, or skipped after `stop`
    seconds: float  # since the warm-up started (to the end once done)
    failed: int  # programs whose build raised (they compile again when a step needs them)
