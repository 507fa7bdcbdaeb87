"""One request as the engine holds it while it runs: its sequences and what they produced."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

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
    checkers: InitVar[list[StopChecker]]  # one per sequence, which carries it
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    error: str | None = None
    # one entry per prompt token when params.prompt_logprobs is set (the first is None): the first
    # sequence computes them; they are delivered once, when all have arrived, and at the end
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self, checkers: list[StopChecker]) -> None:
        for seq, checker in zip(self.seqs, checkers, strict=True):
            seq.stop_checker = checker
        self.logprobs = self.logprobs or [[] for _ in self.seqs]
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def has_prompt_logprobs(self) -> bool:
        """Every prompt token's log-probability has arrived."""
        return self.prompt_logprobs is not None and self.seqs[0].num_prompt_logprobs == len(self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)
