"""One request as the engine holds it while it runs: its sequences and what they produced."""

from __future__ import annotations

from dataclasses import dataclass, field

from zipage_jax.engine.outputs import TokenLogprob
from zipage_jax.engine.sequence import Sequence
from zipage_jax.engine.stop_checker import StopChecker
from zipage_jax.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # its n completions
    checkers: list[StopChecker]  # one per sequence
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[str | int | None] = field(default_factory=list)
    error: str | None = None
    # one entry per prompt token when params.prompt_logprobs is set (the first is None): entries
    # [0, num_prompt_logprobs) have arrived; they are delivered once, when all have, and at the end
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_logprobs: int = 1
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        n = len(self.seqs)
        self.logprobs = self.logprobs or [[] for _ in range(n)]
        self.finish_reasons = self.finish_reasons or [None] * n
        self.stop_reasons = self.stop_reasons or [None] * n
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def has_prompt_logprobs(self) -> bool:
        """Every prompt token's log-probability has arrived."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs == len(self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)
