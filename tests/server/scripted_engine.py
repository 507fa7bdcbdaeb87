"""ScriptedEngine: the engine's public API with scripted tokens instead of the device.

add_request is a real LLMEngine's (every admission check, then that engine drops the request),
so the server in front sees the real engine's errors; each step then gives every completion
its next token from a fixed script, with log-probabilities if asked, until max_tokens. For
tests of the HTTP layer that would otherwise spend their time compiling model steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zipage_jax.engine.llm_engine import EngineStats, LLMEngine
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.sampling_params import SamplingParams

SCRIPT_TEXT = " the quick brown fox"


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    text: str = ""


class ScriptedEngine:
    failed = None  # it never fails for good
    healthy = True
    warmup_status = None  # it builds no programs

    def __init__(self, **options):
        self._engine = LLMEngine(**options)
        self.config, self.tokenizer = self._engine.config, self._engine.tokenizer
        self.max_model_len = self._engine.max_model_len
        self._script = list(self.tokenizer(SCRIPT_TEXT, add_special_tokens=False)["input_ids"])
        self._requests: dict[str, _Request] = {}

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        request_id = self._engine.add_request(prompt, params, request_id)
        self._engine.abort(request_id)
        self._requests[request_id] = _Request(list(prompt), params or SamplingParams())
        return request_id

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_stats(self) -> EngineStats:
        return self._engine.get_stats()

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, r in list(self._requests.items()):
            token = self._script[len(r.tokens) % len(self._script)]
            r.tokens.append(token)
            text = self.tokenizer.decode(r.tokens)
            delta, r.text = text[len(r.text):], text
            finished = len(r.tokens) >= r.params.max_tokens
            logprobs = None
            if r.params.logprobs is not None:
                top = [(t, -0.25 * (i + 1)) for i, t in enumerate(self._script)][: r.params.logprobs]
                logprobs = [TokenLogprob(t, -0.25, top) for t in r.tokens]
            completions = [CompletionOutput(i, r.text, list(r.tokens), "length" if finished else None,
                                            delta_text=delta, delta_token_ids=[token], logprobs=logprobs,
                                            metrics={"ttft_s": 0.0, "latency_s": 0.0})
                           for i in range(r.params.n)]
            outputs.append(RequestOutput(request_id, None, r.prompt_token_ids, completions, finished))
            if finished:
                del self._requests[request_id]
        return outputs
