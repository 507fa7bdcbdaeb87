"""Delivery: what the server has been sent of one request, so that the request can run again on
another replica (its replica died) without the client seeing anything twice.

A request that runs again computes its tokens again. While the new run's tokens and text repeat
what was delivered they are held back; from where the delivery stopped on, they go out as
usual. This holds only for a request whose tokens are the same in every run (greedy, or
seeded): a run that departs from what was delivered raises Diverged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from zipage_jax.engine.outputs import CompletionOutput, RequestOutput


class Diverged(Exception):
    """A run of the request produced other tokens or text than those already delivered."""


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)  # delivered
    text: list[str] = field(default_factory=list)  # delivered, in pieces
    finished: bool = False  # its finish was delivered
    run_tokens: int = 0  # tokens of the current run so far
    run_chars: int = 0  # text of the current run so far
    replay_text: str = ""  # the text delivered before the current run started


class Delivery:
    def __init__(self) -> None:
        self._completions: dict[int, _Completion] = {}

    @property
    def started(self) -> bool:
        """Some token or text was delivered."""
        return any(c.token_ids or any(c.text) for c in self._completions.values())

    def restart(self) -> None:
        """The request runs again from its prompt."""
        for c in self._completions.values():
            c.replay_text = "".join(c.text)
            c.text = [c.replay_text]
            c.run_tokens = c.run_chars = 0

    def admit(self, output: RequestOutput) -> RequestOutput | None:
        """What of the current run's `output` is new to the server (None: nothing); Diverged if
        it contradicts what was delivered."""
        completions = [self._admit(o) for o in output.outputs]
        news = [new for new, _ in completions]
        if not output.finished and output.prompt_logprobs is None and not any(news):
            return None
        shown = [o for _, o in completions]
        if all(a is b for a, b in zip(shown, output.outputs)):
            return output
        return dataclasses.replace(output, outputs=shown)

    def _admit(self, o: CompletionOutput) -> tuple[bool, CompletionOutput]:
        c = self._completions.setdefault(o.index, _Completion())
        ids, text = o.delta_token_ids, o.delta_text
        seen_ids = c.token_ids[c.run_tokens:c.run_tokens + len(ids)]
        seen_text = c.replay_text[c.run_chars:c.run_chars + len(text)]
        if ids[:len(seen_ids)] != seen_ids or text[:len(seen_text)] != seen_text:
            raise Diverged(f"completion {o.index} departs from the tokens delivered before its replica was lost")
        c.run_tokens += len(ids)
        c.run_chars += len(text)
        if o.finished and c.run_tokens < len(c.token_ids):
            raise Diverged(f"completion {o.index} ended before the tokens delivered before its replica was lost")
        new_ids, new_text = ids[len(seen_ids):], text[len(seen_text):]
        c.token_ids += new_ids
        if new_text:
            c.text.append(new_text)
        newly_finished = o.finished and not c.finished
        c.finished = c.finished or o.finished
        if len(new_ids) == len(ids) and len(new_text) == len(text):
            return bool(ids or text or newly_finished), o
        logprobs = None if o.delta_logprobs is None else o.delta_logprobs[len(ids) - len(new_ids):]
        shown = dataclasses.replace(o, delta_token_ids=new_ids, delta_text=new_text, delta_logprobs=logprobs)
        return bool(new_ids or new_text or newly_finished), shown
