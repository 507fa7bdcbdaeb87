"""Postprocessing: sampled tokens and failures become per-request outputs.

Per step, `StepOutputs` collects what each touched request gained (token ids, text and
log-probability deltas) and finishes sequences whose stop checker, length, completed grammar
(structured outputs) or failure says so; a token the grammar refuses fails its request alone;
`outputs()` then builds one RequestOutput per touched request and forgets finished requests.
"""

from __future__ import annotations

import logging
import time

from zipage_jax.engine.grammar import TokenRejected
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.engine.request import Request
from zipage_jax.engine.runner import PromptLogprobsResult, StepResult
from zipage_jax.engine.scheduler import Scheduler
from zipage_jax.engine.sequence import Sequence

logger = logging.getLogger("zipage_jax")


class StepOutputs:
    def __init__(self, requests: dict[str, Request], scheduler: Scheduler):
        self.requests, self.scheduler = requests, scheduler
        self.touched: dict[str, Request] = {}
        self.deltas: dict[int, tuple[str, list[int], list[TokenLogprob]]] = {}  # by seq_id
        self.num_tokens = 0  # tokens that joined a running request

    def add(self, res: StepResult | PromptLogprobsResult) -> None:
        """One result of a fetched step, in the order the runner yields them."""
        if isinstance(res, PromptLogprobsResult):
            self.prompt_logprobs(res)
        else:
            self.token(res)

    def token(self, res: StepResult) -> None:
        """One sampled token reached the host."""
        seq = res.chunk.seq
        if seq.is_finished:
            return  # finished or aborted since this step was dispatched: its token is dropped
        request = self.requests.get(seq.request_id)
        if request is None:
            return
        try:
            complete = seq.grammar is not None and seq.grammar.accept(res.token_id)
        except TokenRejected as exc:
            self.fail(seq, exc)
            return
        seq.resolve(res.token_id)
        self.scheduler.block_manager.commit_full_blocks(seq)  # blocks whose tokens are all known now
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        self.num_tokens += 1
        logprob = None
        if seq.params.logprobs is not None:
            top = [(int(t), float(lp)) for t, lp in zip(res.top_ids, res.top_logprobs)][: seq.params.logprobs]
            logprob = TokenLogprob(res.token_id, res.logprob, top)
            request.logprobs[seq.index].append(logprob)
        checker = request.checkers[seq.index]
        delta, reason = checker.append(res.token_id, final=complete)
        if reason is None and seq.num_known_tokens >= seq.max_len:
            reason = "length"  # the sequence's length limit (max_model_len, or the pool for full KV)
        text, ids, lps = self.deltas.setdefault(seq.seq_id, ("", [], []))
        ids.append(res.token_id)
        if logprob is not None:
            lps.append(logprob)
        self.deltas[seq.seq_id] = (text + delta, ids, lps)
        if reason is not None:
            request.finish_reasons[seq.index] = reason
            request.stop_reasons[seq.index] = checker.stop_reason
            self._finish(seq)
        self.touched[request.request_id] = request

    def prompt_logprobs(self, res: PromptLogprobsResult) -> None:
        """One chunk's prompt log-probabilities reached the host."""
        seq = res.chunk.seq
        request = self.requests.get(seq.request_id)
        if seq.is_finished or request is None or request.has_prompt_logprobs:
            return  # a recompute after preemption computes them again: the first ones stay
        n, top_n = len(res.logprobs), seq.params.prompt_logprobs
        for i, lp, ids, lps in zip(range(res.first, res.first + n), res.logprobs, res.top_ids, res.top_logprobs):
            top = [(int(t), float(v)) for t, v in zip(ids[:top_n], lps[:top_n])]
            request.prompt_logprobs[i] = TokenLogprob(request.prompt_token_ids[i], float(lp), top)
        if res.first <= request.num_prompt_logprobs:
            request.num_prompt_logprobs = max(request.num_prompt_logprobs, res.first + n)
        seq.computes_prompt_logprobs = not request.has_prompt_logprobs

    def fail(self, seq: Sequence, error: Exception) -> None:
        """A failure that belongs to one request: all its sequences finish with "error"."""
        request = self.requests.get(seq.request_id)
        logger.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                     exc_info=(type(error), error, error.__traceback__))
        if request is None:
            return
        request.error = f"{type(error).__name__}: {error}"
        for s in request.seqs:
            if request.finish_reasons[s.index] is None:
                request.finish_reasons[s.index] = "error"
                self._finish(s)
        self.touched[request.request_id] = request

    def outputs(self) -> list[RequestOutput]:
        return [self._output(r) for r in self.touched.values()]

    def _finish(self, seq: Sequence) -> None:
        seq.metrics.finish_time = time.monotonic()
        seq.drop_pending()
        self.scheduler.finish(seq)

    def _output(self, request: Request) -> RequestOutput:
        finished = request.finished  # the cumulative fields cost O(length): only in the final output
        wants_logprobs = request.params.logprobs is not None
        outputs = []
        for seq, checker in zip(request.seqs, request.checkers):
            text, ids, lps = self.deltas.get(seq.seq_id, ("", [], []))
            outputs.append(CompletionOutput(
                index=seq.index, text=checker.text if finished else "",
                token_ids=seq.token_ids[seq.num_prompt_tokens:] if finished else [],
                finish_reason=request.finish_reasons[seq.index], stop_reason=request.stop_reasons[seq.index],
                delta_text=text, delta_token_ids=ids,
                logprobs=request.logprobs[seq.index] if wants_logprobs and finished else None,
                delta_logprobs=lps if wants_logprobs else None,
                metrics=seq_metrics(seq)))
        if finished:
            self.requests.pop(request.request_id, None)
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
