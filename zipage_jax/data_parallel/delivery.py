"""Delivery: what the front has handed on of one request, so that the request can run again on
another replica (its replica died) without the client seeing anything twice.

Per sequence (by completion index) it keeps the token ids handed on. A request that runs again
computes its tokens again: the new run's first tokens, as many as were handed on, are held back
(they must be the same tokens); from there on they go out as usual. The prompt's
log-probabilities are held back alike, by prompt position. This holds only for a request whose
tokens are the same in every run (greedy, or seeded): a run that departs from what was handed
on, or ends before it has caught up with it, raises Diverged.
"""

from __future__ import annotations

from collections.abc import Sequence


class Diverged(Exception):
    """A run of the request produced other tokens than those already handed on."""


class Delivery:
    def __init__(self, n: int):
        """A request of `n` sequences."""
        self._delivered: list[list[int]] = [[] for _ in range(n)]  # token ids handed on, by completion index
        self._run = [0] * n  # tokens of the current run so far
        self._prompt_logprobs = 0  # prompt positions [0, this) had their log-probabilities handed on

    @property
    def started(self) -> bool:
        """Some token was handed on."""
        return any(self._delivered)

    def restart(self) -> None:
        """The request runs again from its prompt."""
        self._run = [0] * len(self._run)

    def hand_on(self, index: int, token_ids: Sequence[int]) -> int:
        """The current run's next tokens of completion `index`: how many of them, from the first,
        were handed on before (to hold back); the others count as handed on from now.
        Diverged if they depart from what was handed on."""
        delivered, run = self._delivered[index], self._run[index]
        token_ids = list(token_ids)
        seen = delivered[run:run + len(token_ids)]
        if token_ids[:len(seen)] != seen:
            raise Diverged(f"completion {index} departs from the tokens delivered before its replica was lost")
        self._run[index] = run + len(token_ids)
        delivered.extend(token_ids[len(seen):])
        return len(seen)

    def finish(self, index: int) -> None:
        """The current run ended completion `index`: Diverged if it had not yet produced every
        token handed on."""
        if self._run[index] < len(self._delivered[index]):
            raise Diverged(f"completion {index} ended before the tokens delivered before its replica was lost")

    def hand_on_prompt_logprobs(self, first: int, count: int) -> int:
        """Log-probabilities of prompt positions [first, first + count) arrived: how many of them,
        from the first, were handed on before (to hold back)."""
        held = max(0, min(count, self._prompt_logprobs - first))
        self._prompt_logprobs = max(self._prompt_logprobs, first + count)
        return held
