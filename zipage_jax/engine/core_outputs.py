"""What the engine core hands back each step: token ids by sequence and finish reasons, nothing
per token that is a Python object. Detokenization, stop strings, log-probability formatting and
`RequestOutput`s are the output stage's (engine/output_processor.py), in the API process for the
server.

The outputs travel between processes as msgpack (`to_msgpack` / `from_msgpack`): arrays as their
raw bytes, everything else as plain lists and numbers; nothing is pickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from zipage_jax.engine.sequence import SequenceMetrics


@dataclass
class FinishedSequence:
    seq_id: int
    reason: str  # "stop", "length" or "error"
    stop_reason: int | str | None  # the stop token id (None for EOS, a grammar's end, length)
    stop_token: bool  # its last token is EOS or a stop token id (whose text is not shown)
    metrics: SequenceMetrics


@dataclass
class EngineCoreOutputs:
    """One step's results, in order: tokens (`seq_ids[i]` got `token_ids[i]`), then the sequences
    they finished. A sequence's tokens come in order across steps; none follow its finish."""

    seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n]
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [n]
    # when some token's sequence asked for log-probabilities: each token's, and the top alternatives
    logprobs: np.ndarray | None = None  # [n] f32
    top_ids: np.ndarray | None = None  # [n, MAX_LOGPROBS] i32
    top_logprobs: np.ndarray | None = None  # [n, MAX_LOGPROBS] f32
    finished: list[FinishedSequence] = field(default_factory=list)
    # (request id, "Type: message", the exception where it was raised in this process, else None)
    failures: list[tuple[str, str, BaseException | None]] = field(default_factory=list)
    # (seq id, index of the first prompt token, logprobs [k], top ids [k, MAX], top logprobs [k, MAX])
    prompt_logprobs: list[tuple] = field(default_factory=list)
    compressed: list[int] = field(default_factory=list)  # seq ids compacted this step
    kv_tokens_evicted: int = 0

    def add_tokens(self, seq_ids: np.ndarray, token_ids: np.ndarray, logprobs: tuple | None) -> None:
        """More tokens (a later step read back in the same engine step comes after)."""
        if not len(seq_ids):
            return
        if logprobs is not None and self.logprobs is None:
            k = logprobs[1].shape[1]
            n = len(self.seq_ids)
            self.logprobs, self.top_ids, self.top_logprobs = (np.zeros(n, np.float32), np.zeros((n, k), np.int32),
                                                              np.zeros((n, k), np.float32))
        if self.logprobs is not None:
            if logprobs is None:
                k = self.top_ids.shape[1]
                logprobs = (np.zeros(len(seq_ids), np.float32), np.zeros((len(seq_ids), k), np.int32),
                            np.zeros((len(seq_ids), k), np.float32))
            self.logprobs, self.top_ids, self.top_logprobs = (
                np.concatenate([mine, theirs]) for mine, theirs in
                zip((self.logprobs, self.top_ids, self.top_logprobs), logprobs))
        self.seq_ids = np.concatenate([self.seq_ids, seq_ids]) if len(self.seq_ids) else seq_ids
        self.token_ids = np.concatenate([self.token_ids, token_ids]) if len(self.token_ids) else token_ids

    def extend(self, later: EngineCoreOutputs) -> None:
        """The outputs of a later step appended (one output stage pass over both)."""
        logprobs = None if later.logprobs is None else (later.logprobs, later.top_ids, later.top_logprobs)
        self.add_tokens(later.seq_ids, later.token_ids, logprobs)
        self.finished += later.finished
        self.failures += later.failures
        self.prompt_logprobs += later.prompt_logprobs
        self.compressed += later.compressed
        self.kv_tokens_evicted += later.kv_tokens_evicted

    @property
    def empty(self) -> bool:
        return not (len(self.seq_ids) or self.finished or self.failures or self.prompt_logprobs or self.compressed)

    # -- across a process boundary ------------------------------------------------------------

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> EngineCoreOutputs:
        return cls.from_wire(msgpack.unpackb(data, raw=False, strict_map_key=False))

    def to_wire(self) -> dict:
        """Plain types only (msgpack's): arrays as (dtype, shape, bytes)."""
        return {
            "seq_ids": _array(self.seq_ids), "token_ids": _array(self.token_ids),
            "logprobs": None if self.logprobs is None else [_array(a) for a in
                                                            (self.logprobs, self.top_ids, self.top_logprobs)],
            "finished": [[f.seq_id, f.reason, f.stop_reason, f.stop_token, dataclasses.asdict(f.metrics)]
                         for f in self.finished],
            "failures": [[request_id, message] for request_id, message, _ in self.failures],
            "prompt_logprobs": [[seq_id, first, *(_array(np.asarray(a)) for a in arrays)]
                                for seq_id, first, *arrays in self.prompt_logprobs],
            "compressed": self.compressed, "kv_tokens_evicted": self.kv_tokens_evicted,
        }

    @classmethod
    def from_wire(cls, wire: dict) -> EngineCoreOutputs:
        logprobs = wire["logprobs"]
        return cls(
            seq_ids=_from_array(wire["seq_ids"]), token_ids=_from_array(wire["token_ids"]),
            logprobs=None if logprobs is None else _from_array(logprobs[0]),
            top_ids=None if logprobs is None else _from_array(logprobs[1]),
            top_logprobs=None if logprobs is None else _from_array(logprobs[2]),
            finished=[FinishedSequence(seq_id, reason, stop_reason, stop_token, SequenceMetrics(**metrics))
                      for seq_id, reason, stop_reason, stop_token, metrics in wire["finished"]],
            failures=[(request_id, message, None) for request_id, message in wire["failures"]],
            prompt_logprobs=[(seq_id, first, *(_from_array(a) for a in arrays))
                             for seq_id, first, *arrays in wire["prompt_logprobs"]],
            compressed=list(wire["compressed"]), kv_tokens_evicted=wire["kv_tokens_evicted"])


def _array(a: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), a.tobytes()]


def _from_array(wire: list[Any]) -> np.ndarray:
    dtype, shape, data = wire
    if np.dtype(dtype).kind not in "biuf":
        raise ValueError(f"unexpected array dtype {dtype!r} in the engine's outputs")
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
