"""`bench soak`'s traffic mix: the kinds of request it sends, their default weights, and each
request as it goes on the wire, with the answer it deserves.

A kind's requests vary (stream or whole, lengths, budgets, seeds) by the mix's seeded random
generator, so one --seed gives one sequence of requests. The greedy kind cycles through a fixed
set of cases (GREEDY_PROMPTS, full KV and GREEDY_BUDGET), which the bench runs again offline.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from zipage_jax.bench.data_parallel import WORDS

KINDS = {  # name: (default weight, what it sends)
    "completion": (3.0, "/v1/completions, full KV, sampled, streamed or whole"),
    "chat": (3.0, "/v1/chat/completions, full KV, sampled, streamed or whole"),
    "compressed": (3.0, "either endpoint with a per-request kv_budget (fixed, with an eviction policy, or auto)"),
    "structured": (1.0, "chat with response_format json_schema; a finished answer must parse and hold its keys"),
    "tools": (1.0, "chat with tools and tool_choice required or a named function; the calls must name a tool"),
    "n": (1.0, "n of 2 or 3 completions, sampled without a seed, streamed or whole"),
    "logprobs": (1.0, "logprobs (completions) or top_logprobs (chat): one entry per generated token"),
    "greedy": (2.0, "temperature 0 on a fixed prompt, full KV or the compressed case, checked against offline"),
    "disconnect": (1.0, "a stream the client drops after a few chunks"),
    "bad_json": (0.3, "malformed JSON: 400"),
    "bad_field": (0.3, "a field out of range, unknown or of the wrong type: 400"),
    "oversize": (0.2, "a body over the server's --max-request-bytes: 413"),
}
GREEDY_PROMPTS = (
    "The history of the printing press begins",
    "A recipe for bread needs flour, water and",
    "In a small town by the sea there lived",
    "The three laws of motion state that",
)
GREEDY_BUDGET = 32  # the compressed greedy case's kv_budget in tokens
GREEDY_TOKENS = 32
BUDGETS = (32, 48, "auto")  # the compressed kind's kv_budget
POLICIES = ("zipage", "streaming", "window", "rkv")  # with a fixed budget, sent as eviction_policy
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
           "required": ["answer", "score"]}
TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
         for name, text, arg in (("get_weather", "the weather in a city", "city"),
                                 ("get_time", "the time in a time zone", "zone"))]
_BAD_FIELDS = ({"temperature": -1}, {"max_tokens": -5}, {"n": "two"}, {"no_such_field": 1}, {"top_p": 2})


@dataclass(frozen=True)
class GreedyCase:
    prompt: str
    kv_budget: int | None  # None: full KV


GREEDY_CASES = tuple(GreedyCase(p, b) for b in (None, GREEDY_BUDGET) for p in GREEDY_PROMPTS)


@dataclass(frozen=True)
class Planned:
    """One request as sent, and what it deserves."""

    kind: str
    path: str
    body: bytes  # what goes on the wire (not JSON for bad_json)
    stream: bool
    expect: int  # the status it deserves
    replayable: bool  # greedy or seeded: a replica's death may not fail it (its rerun gives the same tokens)
    n: int = 1
    disconnect_after: int | None = None  # data events read before the client goes away
    greedy_case: int | None = None  # index into GREEDY_CASES


def parse_weights(pairs: list[str]) -> dict[str, float]:
    """KINDS' default weights with KIND=WEIGHT pairs over them; ValueError for an unknown kind,
    a weight that is not a number >= 0, or no weight above 0."""
    weights = {kind: weight for kind, (weight, _) in KINDS.items()}
    for pair in pairs:
        kind, sep, value = pair.partition("=")
        if not sep or kind not in KINDS:
            raise ValueError(f"--mix takes KIND=WEIGHT with KIND one of {', '.join(KINDS)}; got {pair!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--mix {pair!r}: the weight must be a number") from None
        if not weight >= 0:
            raise ValueError(f"--mix {pair!r}: the weight must be >= 0")
        weights[kind] = weight
    if not any(weights.values()):
        raise ValueError("--mix leaves every kind at weight 0")
    return weights


class Mix:
    """Requests of the kinds in `weights`, drawn with random.Random(seed)."""

    def __init__(self, weights: dict[str, float], seed: int, model: str, max_request_bytes: int):
        self.weights, self.model, self.max_request_bytes = weights, model, max_request_bytes
        self.rng = random.Random(seed)
        self._next_greedy = 0
        self._seeds = iter(range(seed * 1_000_003, 2**31))

    def next(self) -> Planned:
        kinds = [k for k, w in self.weights.items() if w > 0]
        return self.build(self.rng.choices(kinds, [self.weights[k] for k in kinds])[0])

    def one_of_each(self) -> list[Planned]:
        """A request of every kind with a weight, and every greedy case (the warm-up's start)."""
        planned = [self.build(kind) for kind, w in self.weights.items() if w > 0 and kind != "greedy"]
        return planned + [self._greedy(i) for i in range(len(GREEDY_CASES))]

    def build(self, kind: str) -> Planned:
        rng = self.rng
        if kind == "greedy":
            case = self._next_greedy
            self._next_greedy = (case + 1) % len(GREEDY_CASES)
            return self._greedy(case)
        if kind in ("bad_json", "bad_field", "oversize"):
            return self._bad(kind)
        if kind == "disconnect":
            body = self._completion(64, stream=True)
            return self._planned(kind, COMPLETIONS, body, disconnect_after=rng.randint(1, 4))
        if kind == "structured":
            body = self._chat(48, stream=False, response_format={
                "type": "json_schema", "json_schema": {"name": "verdict", "schema": _SCHEMA}})
            return self._planned(kind, CHAT, body)
        if kind == "tools":
            choice = rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
            return self._planned(kind, CHAT, self._chat(48, stream=False, tools=TOOLS, tool_choice=choice))
        if kind == "logprobs":
            if rng.random() < 0.5:
                return self._planned(kind, COMPLETIONS, self._completion(16, stream=False, logprobs=2))
            return self._planned(kind, CHAT, self._chat(16, stream=False, logprobs=True, top_logprobs=2))
        stream = rng.random() < 0.5
        if kind == "n":
            n = rng.choice([2, 3])
            body = self._completion(16, stream, may_seed=False, n=n)
            return self._planned(kind, COMPLETIONS, body, n=n)
        extra: dict = {}
        words, tokens = 8, rng.randint(8, 32)
        if kind == "compressed":
            budget = rng.choice(BUDGETS)
            extra = {"kv_budget": budget}
            if budget != "auto":
                extra["eviction_policy"] = rng.choice(POLICIES)
            words, tokens = rng.randint(20, 40), rng.randint(48, 64)
        if kind == "chat" or (kind == "compressed" and rng.random() < 0.5):
            return self._planned(kind, CHAT, self._chat(tokens, stream, words=words, **extra))
        return self._planned(kind, COMPLETIONS, self._completion(tokens, stream, words=words, **extra))

    def _greedy(self, case: int) -> Planned:
        c = GREEDY_CASES[case]
        body = {"model": self.model, "prompt": c.prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        if c.kv_budget is not None:
            body["kv_budget"] = c.kv_budget
        return Planned("greedy", COMPLETIONS, _json(body), stream=False, expect=200, replayable=True,
                       greedy_case=case)

    def _bad(self, kind: str) -> Planned:
        if kind == "bad_json":
            body = _json({"model": self.model, "prompt": self._words(4), "max_tokens": 8})[:-self.rng.randint(1, 12)]
            return Planned(kind, COMPLETIONS, body, stream=False, expect=400, replayable=True)
        if kind == "bad_field":
            body = {"model": self.model, "prompt": self._words(4), "max_tokens": 8, **self.rng.choice(_BAD_FIELDS)}
            return Planned(kind, COMPLETIONS, _json(body), stream=False, expect=400, replayable=True)
        head = b'{"model": %s, "prompt": "' % json.dumps(self.model).encode()
        padding = self.max_request_bytes + 1 - len(head) - 2
        return Planned(kind, COMPLETIONS, head + b"a" * padding + b'"}', stream=False, expect=413, replayable=True)

    def _planned(self, kind: str, path: str, body: dict, n: int = 1, disconnect_after: int | None = None) -> Planned:
        replayable = body.get("temperature") == 0 or body.get("seed") is not None
        return Planned(kind, path, _json(body), stream=body["stream"], expect=200, replayable=replayable, n=n,
                       disconnect_after=disconnect_after)

    def _sampling(self, max_tokens: int, stream: bool, may_seed: bool) -> dict:
        """Sampled at temperature 0.8; with `may_seed`, half of them seeded."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "stream": stream}
        if may_seed and self.rng.random() < 0.5:
            body["seed"] = next(self._seeds)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _completion(self, max_tokens: int, stream: bool, words: int = 8, may_seed: bool = True, **extra) -> dict:
        return {**self._sampling(max_tokens, stream, may_seed), "prompt": self._words(words), **extra}

    def _chat(self, max_tokens: int, stream: bool, words: int = 8, **extra) -> dict:
        messages = [{"role": "user", "content": self._words(words)}]
        return {**self._sampling(max_tokens, stream, True), "messages": messages, **extra}

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n)).capitalize()


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()
