"""Postprocessing: what a step changed becomes one RequestOutput per touched request.

The scheduler applies a step's output (`Scheduler.update_from_output`); its `StepUpdate`s are
collected here, per step: what each touched request gained (token ids, text and log-probability
deltas), its prompt log-probabilities and its error. `outputs()` then builds one RequestOutput per
touched request, the whole completion once it has finished. Nothing here changes the scheduler,
a sequence or the engine's requests: only each request's own output fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.engine.request import Request
from zipage_jax.engine.runner.results import PromptLogprobsResult, StepResult
from zipage_jax.engine.scheduler import StepUpdate
from zipage_jax.engine.sequence import Sequence

logger = logging.getLogger("zipage_jax")


class StepOutputs:
    def __init__(self, requests: Mapping[str, Request]):
        self.requests = requests
        self.touched: dict[str, Request] = {}
        self.deltas: dict[int, tuple[str, list[int], list[TokenLogprob]]] = {}  # by seq_id
        self.num_tokens = 0  # tokens that joined a running request

    def add(self, update: StepUpdate) -> None:
        """What one application of a step's output changed."""
        for seq, error in update.failures:
            self._fail(seq, error)
        for res in update.prompt_logprobs:
            self._prompt_logprobs(res)
        for seq, res, text in update.tokens:
            self._token(seq, res, text)

    def _token(self, seq: Sequence, res: StepResult, text: str) -> None:
        """One sampled token joined `seq`; its stop checker released `text`."""
        request = self.requests[seq.request_id]
        self.num_tokens += 1
        logprob = None
        if seq.params.logprobs is not None:
            top = [(int(t), float(lp)) for t, lp in zip(res.top_ids, res.top_logprobs)][: seq.params.logprobs]
            logprob = TokenLogprob(res.token_id, res.logprob, top)
            request.logprobs[seq.index].append(logprob)
        delta, ids, lps = self.deltas.setdefault(seq.seq_id, ("", [], []))
        ids.append(res.token_id)
        if logprob is not None:
            lps.append(logprob)
        self.deltas[seq.seq_id] = (delta + text, ids, lps)
        self.touched[request.request_id] = request

    def _prompt_logprobs(self, res: PromptLogprobsResult) -> None:
        """One chunk's prompt log-probabilities reached the host."""
        request = self.requests[res.chunk.seq.request_id]
        top_n = request.params.prompt_logprobs
        first = res.first
        for i, lp, ids, lps in zip(range(first, first + len(res.logprobs)), res.logprobs, res.top_ids,
                                   res.top_logprobs):
            top = [(int(t), float(v)) for t, v in zip(ids[:top_n], lps[:top_n])]
            request.prompt_logprobs[i] = TokenLogprob(request.prompt_token_ids[i], float(lp), top)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """A failure that belongs to one request (the scheduler finished its sequences)."""
        logger.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                     exc_info=(type(error), error, error.__traceback__))
        request = self.requests[seq.request_id]
        request.error = f"{type(error).__name__}: {error}"
        self.touched[request.request_id] = request

    def outputs(self) -> list[RequestOutput]:
        return [self._output(r) for r in self.touched.values()]

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finished  # the cumulative fields cost O(length): only in the final output
        wants_logprobs = request.params.logprobs is not None
        outputs = []
        for seq in request.seqs:
            text, ids, lps = self.deltas.get(seq.seq_id, ("", [], []))
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.stop_checker.text if finished else "",
                token_ids=seq.token_ids[seq.num_prompt_tokens:] if finished else [],
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=text, delta_token_ids=ids,
                logprobs=request.logprobs[seq.index] if wants_logprobs and finished else None,
                delta_logprobs=lps if wants_logprobs else None,
                metrics=seq_metrics(seq)))
        prompt_logprobs = None
        if request.has_prompt_logprobs and (finished or not request.prompt_logprobs_sent):
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             error=request.error, prompt_logprobs=prompt_logprobs)


def seq_metrics(seq: Sequence) -> dict:
    m = seq.metrics
    end = m.finish_time or time.monotonic()
    return {
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": seq.num_known_tokens - seq.num_prompt_tokens,
        "cached_prompt_tokens": m.num_cached_prompt_tokens,
        "ttft_s": None if m.first_token_time is None else m.first_token_time - m.arrival_time,
        "latency_s": end - m.arrival_time,
        "num_preemptions": m.num_preemptions,
        "num_compressions": m.num_compressions,
        "kv_blocks_peak": m.kv_blocks_peak,
        "kv_tokens_evicted": m.kv_tokens_evicted,
    }
