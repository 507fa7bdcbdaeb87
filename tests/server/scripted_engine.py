"""ScriptedEngine: an engine core with scripted tokens instead of the device.

add_requests is a real EngineCore's (every admission check, then that core drops the requests),
so the server in front sees the real engine's errors; each step then gives every sequence its
next token id from a script, with log-probabilities if asked. The default script repeats until
max_tokens ("length"); a script set as `script` (or given as script_text) is the model's whole
output: its tokens, then EOS ("stop"), unless max_tokens comes first. A request keeps the script
it started with. Text, stop strings and RequestOutputs are the server's output stage's, as with
the real core. For tests of the HTTP layer that would otherwise spend their time compiling model
steps.

Its steps take no time: a streaming handler then lags behind them and gets its outputs merged
(several tokens a chunk, server/output_sink.py). A test of chunk-by-chunk streaming slows the steps
(`step_delay`, server_harness.slow_steps) so that the server keeps up: a chunk per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from zipage_jax.engine.core import AdmittedRequest, EngineCore
from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.engine.stats import EngineStats
from zipage_jax.sampling_params import SamplingParams

SCRIPT_TEXT = " the quick brown fox"


@dataclass
class _Sequence:
    request_id: str
    params: SamplingParams
    script: list[int]
    ends: bool  # the script is the whole output (else it repeats)
    tokens: list[int] = field(default_factory=list)


class _NoWarmup:
    def stop(self) -> None:
        pass


class ScriptedEngine:
    failed = None  # it never fails for good
    healthy = True
    unhealthy_reason = ""
    warmup_status = None  # it builds no programs
    step_delay = 0.0  # seconds each step sleeps
    last_step_idle = False  # a step always advances every sequence

    def __init__(self, script_text: str | None = None, **options):
        self._core = EngineCore(**options)
        self.config, self.tokenizer = self._core.config, self._core.tokenizer
        self.model_info, self.max_model_len = self._core.model_info, self._core.max_model_len
        self.on_health_change = None  # set by the driver; a scripted core never changes its health
        self.output_lag = 0  # steps the output stage is behind (set_output_lag)
        self.script = script_text
        self.last_params: SamplingParams | None = None  # of the latest request
        self._seqs: dict[int, _Sequence] = {}  # by seq id, while unfinished

    @property
    def script(self) -> str | None:
        return self._script_text

    @script.setter
    def script(self, text: str | None) -> None:
        """The whole output of the requests added from now on (None: SCRIPT_TEXT, repeated)."""
        self._script_text = text
        script = SCRIPT_TEXT if text is None else text
        self._script = list(self.tokenizer(script, add_special_tokens=False)["input_ids"])

    def add_requests(self, requests) -> list[AdmittedRequest]:
        admitted = self._core.add_requests(requests)
        for request in admitted:
            self._core.abort(request.request_id)
            self.last_params = request.params
            for seq_id in request.seq_ids:
                self._seqs[seq_id] = _Sequence(request.request_id, request.params, self._script,
                                               self._script_text is not None)
        return admitted

    def abort(self, request_id: str) -> None:
        for seq_id in [s for s, seq in self._seqs.items() if seq.request_id == request_id]:
            del self._seqs[seq_id]

    def finish_sequences(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def set_output_lag(self, steps: int) -> None:
        self.output_lag = steps

    def start_warmup(self) -> _NoWarmup:
        return _NoWarmup()

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def get_stats(self) -> EngineStats:
        return self._core.get_stats()

    def step(self) -> EngineCoreOutputs:
        time.sleep(self.step_delay)
        out = EngineCoreOutputs()
        stepped = list(self._seqs.items())
        for seq_id, s in stepped:
            at_eos = s.ends and len(s.tokens) == len(s.script)
            s.tokens.append(self.tokenizer.eos_token_id if at_eos else s.script[len(s.tokens) % len(s.script)])
            if at_eos:
                out.finished.append(FinishedSequence(seq_id, "stop", None, True, SequenceMetrics()))
            elif len(s.tokens) >= s.params.max_tokens:
                out.finished.append(FinishedSequence(seq_id, "length", None, False, SequenceMetrics()))
            else:
                continue
            del self._seqs[seq_id]
        if stepped:
            wants_logprobs = any(s.params.logprobs is not None for _, s in stepped)
            out.add_tokens(np.array([seq_id for seq_id, _ in stepped], np.int64),
                           np.array([s.tokens[-1] for _, s in stepped], np.int32),
                           self._logprobs([s for _, s in stepped]) if wants_logprobs else None)
        return out

    def _logprobs(self, seqs: list[_Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each token's log-probability -0.25; its alternatives its script's distinct tokens, then
        other ids, at -0.25, -0.5, ... (as many as the most any of them asked for)."""
        k = max(s.params.logprobs or 0 for s in seqs) or 1
        top_ids = np.zeros((len(seqs), k), np.int32)
        for row, s in enumerate(seqs):
            alternatives = list(dict.fromkeys(s.script))
            alternatives += [t for t in range(k + len(alternatives)) if t not in alternatives]
            top_ids[row] = alternatives[:k]
        top_logprobs = np.tile(np.array([-0.25 * (i + 1) for i in range(k)], np.float32), (len(seqs), 1))
        return np.full(len(seqs), -0.25, np.float32), top_ids, top_logprobs
