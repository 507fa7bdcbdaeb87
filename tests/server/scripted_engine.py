"""ScriptedEngine: the engine's public API with scripted tokens instead of the device.

add_request is a real LLMEngine's (every admission check, then that engine drops the request),
so the server in front sees the real engine's errors; each step then gives every completion
its next token from a script, with log-probabilities if asked. The default script repeats until
max_tokens ("length"); a script set as `script` (or given as script_text) is the model's whole
output: its tokens, then EOS ("stop"), unless max_tokens comes first. A request keeps the script
it started with. For tests of the HTTP layer that would otherwise spend their time compiling
model steps.
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
    script: list[int]
    ends: bool  # the script is the whole output (else it repeats)
    tokens: list[int] = field(default_factory=list)
    text: str = ""


class ScriptedEngine:
    failed = None  # it never fails for good
    healthy = True
    warmup_status = None  # it builds no programs

    def __init__(self, script_text: str | None = None, **options):
        self._engine = LLMEngine(**options)
        self.config, self.tokenizer = self._engine.config, self._engine.tokenizer
        self.max_model_len = self._engine.max_model_len
        self.script = script_text
        self.last_params: SamplingParams | None = None  # of the latest request
        self._requests: dict[str, _Request] = {}

    @property
    def script(self) -> str | None:
        return self._script_text

    @script.setter
    def script(self, text: str | None) -> None:
        """The whole output of the requests added from now on (None: SCRIPT_TEXT, repeated)."""
        self._script_text = text
        script = SCRIPT_TEXT if text is None else text
        self._script = list(self.tokenizer(script, add_special_tokens=False)["input_ids"])

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        request_id = self._engine.add_request(prompt, params, request_id)
        self._engine.abort(request_id)
        self.last_params = params or SamplingParams()
        self._requests[request_id] = _Request(list(prompt), self.last_params, self._script,
                                              self._script_text is not None)
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
            at_eos = r.ends and len(r.tokens) == len(r.script)
            token = self.tokenizer.eos_token_id if at_eos else r.script[len(r.tokens) % len(r.script)]
            text = r.text if at_eos else self.tokenizer.decode(r.tokens + [token])
            r.tokens.append(token)
            delta, r.text = text[len(r.text):], text
            finish_reason = "stop" if at_eos else "length" if len(r.tokens) >= r.params.max_tokens else None
            finished = finish_reason is not None
            logprobs = None
            if r.params.logprobs is not None:
                top = [(t, -0.25 * (i + 1)) for i, t in enumerate(r.script)][: r.params.logprobs]
                logprobs = [TokenLogprob(t, -0.25, top) for t in r.tokens]
            completions = [CompletionOutput(i, r.text, list(r.tokens), finish_reason,
                                            delta_text=delta, delta_token_ids=[token], logprobs=logprobs,
                                            metrics={"ttft_s": 0.0, "latency_s": 0.0})
                           for i in range(r.params.n)]
            outputs.append(RequestOutput(request_id, None, r.prompt_token_ids, completions, finished))
            if finished:
                del self._requests[request_id]
        return outputs
