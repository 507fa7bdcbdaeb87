"""What the engine hands back each step, per completion: what it added this step (the deltas),
and the whole completion once it has finished.

A running request's outputs carry only deltas, so an output costs the same at token 10 and at
token 30,000; `text`, `token_ids` and `logprobs` are filled in the request's final output.
`RequestOutput.prompt_logprobs` (when asked for) comes in the first output after the prefill, the
one with the first generated token, and in the final output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely tokens, most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str  # the whole completion in the request's final output; "" before
    token_ids: list[int]  # likewise
    finish_reason: str | None  # "stop" | "length" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that matched
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # the whole completion's, once finished (when asked for)
    delta_logprobs: list[TokenLogprob] | None = None  # this step's (when asked for)
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # the engine failed this request alone (its finish_reason is "error")
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing
    # predicts it); entry i is log_softmax of the logits at position i - 1, at prompt token i, with
    # the top-N. Shared by the n completions. Under compression during a long prompt, the logits
    # are those of the KV the engine actually kept, as for generated tokens.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict:
        """The `generate` result: the first completion's fields at the top, all of them in
        `outputs`, and the request's metrics."""
        first = self.outputs[0]
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "text": first.text,
            "token_ids": first.token_ids,
            "finish_reason": first.finish_reason,
            "logprobs": None if first.logprobs is None else [asdict(lp) for lp in first.logprobs],
            "prompt_logprobs": None if self.prompt_logprobs is None else [
                None if lp is None else asdict(lp) for lp in self.prompt_logprobs],
            "metrics": first.metrics,
            "outputs": [
                {"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                 "stop_reason": o.stop_reason, "metrics": o.metrics,
                 "logprobs": None if o.logprobs is None else [asdict(lp) for lp in o.logprobs]}
                for o in self.outputs
            ],
        }
