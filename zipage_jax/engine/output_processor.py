"""The output stage: the engine core's token ids and finish reasons become `RequestOutput`s.

Per request it keeps what the core does not: the output token ids, the detokenised text and its
stop strings (StopChecker), the log-probabilities as `TokenLogprob`s, the prompt's
log-probabilities, and the request's timing. It runs outside the engine's step: after each step
in `LLMEngine` (this process), and in the API process for the server, so the step's host time
does not grow with detokenisation or output building.

A request added with `stream=False` gets two outputs: with its first token (it has started: its
time to first token is known) and when it finishes; if it has no stop strings its tokens are
detokenised only then (the same StopChecker over the same tokens, so the text is the same as
streamed). A streamed request gets an output with the deltas whenever it has advanced by
`stream_interval` tokens (1: at every step it advances), and when it finishes. A stop
string ends its sequence here: `process` returns the sequences to finish in the core
(`EngineCore.finish_sequences`); their later tokens, already computed, are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.engine.stop_checker import StopChecker
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax")


@dataclass
class _SequenceState:
    index: int
    checker: StopChecker
    incremental: bool  # detokenised as its tokens come (streamed, or stop strings to match)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    first_token_time: float | None = None
    finish_time: float | None = None
    # this step's deltas
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: list[_SequenceState]
    seq_ids: list[int]
    arrival_time: float
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_logprobs: int = 1  # entries [0, n) have arrived
    prompt_logprobs_sent: bool = False
    started_sent: bool = False  # an output with its first token has gone out
    stream_interval: int = 1  # tokens a streamed output waits for
    unsent: int = 0  # tokens added since the last output

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def has_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and self.num_prompt_logprobs == len(self.prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer, special_ids: Iterable[int] | None = None):
        self.tokenizer = tokenizer
        self.special_ids = frozenset(special_ids if special_ids is not None
                                     else getattr(tokenizer, "all_special_ids", ()))
        self.requests: dict[str, _RequestState] = {}
        self._seqs: dict[int, tuple[_RequestState, _SequenceState]] = {}  # by seq id
        self._num_stop_strings = 0

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    seq_ids: list[int], stream: bool = True, arrival_time: float | None = None,
                    stream_interval: int = 1) -> None:
        """Follows a request the core admitted; `stream`: an output whenever it has advanced by
        `stream_interval` tokens (else only its first and final ones)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        incremental = stream or bool(params.stop)
        seqs = [_SequenceState(i, StopChecker(self.tokenizer, params, prompt_token_ids, self.special_ids),
                               incremental) for i in range(len(seq_ids))]
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, stream, seqs, list(seq_ids),
                              time.monotonic() if arrival_time is None else arrival_time,
                              stream_interval=stream_interval)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        self.requests[request_id] = state
        self._num_stop_strings += bool(params.stop)
        for seq_id, seq in zip(seq_ids, seqs):
            self._seqs[seq_id] = (state, seq)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._drop(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_stop_string_requests(self) -> int:
        """Requests with stop strings, whose ends this stage decides."""
        return self._num_stop_strings

    def process(self, out: EngineCoreOutputs) -> tuple[list[RequestOutput], list[int]]:
        """One step's core outputs -> (the outputs of the requests that advanced, the sequences a
        stop string ended, which the core should finish)."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        stopped: list[int] = []
        for request_id, message, _ in out.failures:
            state = self.requests.get(request_id)
            if state is not None:
                state.error = message
                touched[request_id] = state
        for seq_id in out.compressed:
            found = self._seqs.get(seq_id)
            if found is not None:
                found[1].metrics.num_compressions += 1
        for seq_id, first, logprobs, top_ids, top_logprobs in out.prompt_logprobs:
            found = self._seqs.get(seq_id)
            if found is not None:
                self._prompt_logprobs(found[0], first, logprobs, top_ids, top_logprobs)
        finished = {f.seq_id: f for f in out.finished}
        last = {seq_id: int(np.flatnonzero(out.seq_ids == seq_id)[-1]) for seq_id in finished
                if seq_id in self._seqs and np.any(out.seq_ids == seq_id)}
        seq_ids, token_ids = out.seq_ids.tolist(), out.token_ids.tolist()
        together: dict[int, list[int]] = {}  # a streamed sequence without stop strings: decoded at once below
        for i, (seq_id, token_id) in enumerate(zip(seq_ids, token_ids)):
            found = self._seqs.get(seq_id)
            if found is None:
                continue
            state, seq = found
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core computed past it
            seq.token_ids.append(token_id)
            seq.first_token_time = seq.first_token_time or now
            if state.params.logprobs is not None:
                self._logprob(state, seq, token_id, out, i)
            if seq.incremental and not state.params.stop:
                together.setdefault(seq_id, []).append(token_id)
            elif seq.incremental:  # a stop string may end it at this very token
                end = finished.get(seq_id) if last.get(seq_id) == i else None
                delta, matched = seq.checker.append(token_id, ends=end is not None,
                                                    stop_token=end is not None and end.stop_token)
                seq.delta_text += delta
                if matched:
                    self._finish(seq, "stop", seq.checker.stop_string, now)
                    stopped.append(seq_id)
            seq.delta_ids.append(token_id)
            state.unsent += 1
            touched[state.request_id] = state
        for seq_id, tokens in together.items():
            seq = self._seqs[seq_id][1]
            end = finished.get(seq_id)
            seq.delta_text += seq.checker.extend(tokens, ends=end is not None,
                                                 stop_token=end is not None and end.stop_token)
        for seq_id, end in finished.items():
            found = self._seqs.get(seq_id)
            if found is None or found[1].finish_reason is not None:
                continue
            state, seq = found
            seq.metrics = end.metrics
            if not seq.incremental:
                self._detokenize(seq, end)
            self._finish(seq, end.reason, end.stop_reason, now)
            touched[state.request_id] = state
        due = [state for state in touched.values() if state.finished or state.error is not None
               or not state.started_sent or (state.stream and state.unsent >= state.stream_interval)]
        outputs = [self._output(state, now) for state in due]
        for state in due:
            self._clear_deltas(state)
        for state in touched.values():
            if state.finished or state.error is not None:
                self.requests.pop(state.request_id, None)
                self._drop(state)
        return outputs, stopped

    def _finish(self, seq: _SequenceState, reason: str, stop_reason: str | int | None, now: float) -> None:
        seq.finish_reason, seq.stop_reason, seq.finish_time = reason, stop_reason, now

    @staticmethod
    def _detokenize(seq: _SequenceState, end: FinishedSequence) -> None:
        """A sequence detokenised only now (not streamed, no stop strings): its tokens at once."""
        seq.checker.extend(seq.token_ids, ends=True, stop_token=end.stop_token)

    def _logprob(self, state: _RequestState, seq: _SequenceState, token_id: int, out: EngineCoreOutputs,
                 i: int) -> None:
        k = state.params.logprobs
        top = list(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
        entry = TokenLogprob(token_id, float(out.logprobs[i]), top)
        seq.logprobs.append(entry)
        seq.delta_logprobs.append(entry)

    def _prompt_logprobs(self, state: _RequestState, first: int, logprobs, top_ids, top_logprobs) -> None:
        if state.prompt_logprobs is None or first > state.num_prompt_logprobs:
            return
        top_n = state.params.prompt_logprobs
        for i, lp, ids, lps in zip(range(first, first + len(logprobs)), logprobs, top_ids, top_logprobs):
            top = [(int(t), float(v)) for t, v in zip(ids[:top_n], lps[:top_n])]
            state.prompt_logprobs[i] = TokenLogprob(state.prompt_token_ids[i], float(lp), top)
        state.num_prompt_logprobs = max(state.num_prompt_logprobs, first + len(logprobs))

    def _output(self, state: _RequestState, now: float) -> RequestOutput:
        state.started_sent = True
        finished = state.finished or state.error is not None
        wants_logprobs = state.params.logprobs is not None
        outputs = [CompletionOutput(
            index=seq.index, text=seq.checker.text if finished else "",
            token_ids=list(seq.token_ids) if finished else [],
            finish_reason=seq.finish_reason or ("error" if state.error is not None else None),
            stop_reason=seq.stop_reason, delta_text=seq.delta_text, delta_token_ids=seq.delta_ids,
            logprobs=seq.logprobs if wants_logprobs and finished else None,
            delta_logprobs=seq.delta_logprobs if wants_logprobs else None,
            metrics=_metrics(state, seq, now)) for seq in state.seqs]
        prompt_logprobs = None
        if state.has_prompt_logprobs and (finished or not state.prompt_logprobs_sent):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             error=state.error, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _clear_deltas(state: _RequestState) -> None:
        state.unsent = 0
        for seq in state.seqs:
            seq.delta_text, seq.delta_ids, seq.delta_logprobs = "", [], []

    def _drop(self, state: _RequestState) -> None:
        self._num_stop_strings -= bool(state.params.stop)
        for seq_id in state.seq_ids:
            self._seqs.pop(seq_id, None)


def _metrics(state: _RequestState, seq: _SequenceState, now: float) -> dict:
    m = seq.metrics
    end = seq.finish_time or now
    return {
        "prompt_tokens": len(state.prompt_token_ids),
        "completion_tokens": len(seq.token_ids),
        "cached_prompt_tokens": m.num_cached_prompt_tokens,
        "ttft_s": None if seq.first_token_time is None else seq.first_token_time - state.arrival_time,
        "latency_s": end - state.arrival_time,
        "num_preemptions": m.num_preemptions,
        "num_compressions": m.num_compressions,
        "kv_blocks_peak": m.kv_blocks_peak,
        "kv_budget_tokens": m.kv_budget_tokens,
        "kv_tokens_evicted": m.kv_tokens_evicted,
    }
