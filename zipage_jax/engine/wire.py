"""The engine core's messages between processes: msgpack frames over a stream socket.

A frame is a 4-byte big-endian length and a msgpack map. Everything crosses as plain data:
numbers, strings, lists, maps and raw array bytes (EngineCoreOutputs.to_wire); the receiver
rebuilds its own objects (SamplingParams, EngineConfig, ...) and validates them as if a user had
given them. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading

import msgpack

from zipage_jax.compress.config import CompressionConfig
from zipage_jax.config import EngineConfig
from zipage_jax.engine import driver
from zipage_jax.engine.core import AdmittedRequest, ModelInfo
from zipage_jax.engine.core_outputs import EngineCoreOutputs
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams, StructuredOutputsParams

MAX_FRAME = 1 << 30
_LENGTH = struct.Struct(">I")


class Channel:
    """Frames over a connected socket: `send` from any thread, `recv` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: dict) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        with self._lock:
            self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def recv(self) -> dict | None:
        """The next message; None once the other end has closed."""
        header = self._exactly(_LENGTH.size)
        if header is None:
            return None
        (size,) = _LENGTH.unpack(header)
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes is over the limit of {MAX_FRAME}")
        data = self._exactly(size)
        if data is None:
            return None
        message = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if not isinstance(message, dict):
            raise ValueError(f"a frame must hold a map, got {type(message).__name__}")
        return message

    def _exactly(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- values ---------------------------------------------------------------------------------------


def params_to_wire(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_wire(wire: dict) -> SamplingParams:
    spec = wire.get("structured_outputs")
    return SamplingParams(**{**wire, "structured_outputs": None if spec is None else StructuredOutputsParams(**spec)})


def config_to_wire(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_wire(wire: dict) -> EngineConfig:
    return EngineConfig(**{**wire, "compression": CompressionConfig(**wire["compression"])})


def admitted_to_wire(request: AdmittedRequest) -> dict:
    return {"request_id": request.request_id, "prompt": request.prompt, "prompt_token_ids": request.prompt_token_ids,
            "params": params_to_wire(request.params), "seq_ids": request.seq_ids}


def admitted_from_wire(wire: dict) -> AdmittedRequest:
    return AdmittedRequest(wire["request_id"], wire["prompt"], list(wire["prompt_token_ids"]),
                           params_from_wire(wire["params"]), list(wire["seq_ids"]))


def model_info_to_wire(info: ModelInfo) -> dict:
    return dataclasses.asdict(info)


def model_info_from_wire(wire: dict) -> ModelInfo:
    return ModelInfo(**{**wire, "eos_token_ids": tuple(wire["eos_token_ids"]),
                        "special_ids": tuple(wire["special_ids"])})


# -- the driver's commands and events -----------------------------------------------------------


def command_to_wire(command: driver.Command) -> dict:
    if isinstance(command, driver.Add):
        return {"op": "add", "token": command.token,
                "requests": [[prompt, None if params is None else params_to_wire(params), request_id]
                             for prompt, params, request_id in command.requests]}
    if isinstance(command, driver.Abort):
        return {"op": "abort", "request_id": command.request_id}
    if isinstance(command, driver.FinishSequences):
        return {"op": "finish", "seq_ids": list(command.seq_ids)}
    if isinstance(command, driver.OutputLag):
        return {"op": "lag", "steps_processed": command.steps_processed}
    if isinstance(command, driver.StartWarmup):
        return {"op": "warmup"}
    return {"op": "stop"}


def command_from_wire(wire: dict) -> driver.Command:
    op = wire["op"]
    if op == "add":
        return driver.Add(int(wire["token"]), [
            (prompt if isinstance(prompt, str) else [int(t) for t in prompt],
             None if params is None else params_from_wire(params), request_id)
            for prompt, params, request_id in wire["requests"]])
    if op == "abort":
        return driver.Abort(str(wire["request_id"]))
    if op == "finish":
        return driver.FinishSequences([int(s) for s in wire["seq_ids"]])
    if op == "lag":
        return driver.OutputLag(int(wire["steps_processed"]))
    if op == "warmup":
        return driver.StartWarmup()
    if op == "stop":
        return driver.Stop()
    raise ValueError(f"unknown command {op!r}")


def event_to_wire(event: driver.Event) -> dict:
    if isinstance(event, driver.Outputs):
        return {"ev": "outputs", "step": event.step, "outputs": event.outputs.to_wire()}
    if isinstance(event, driver.Stats):
        return {"ev": "stats", "stats": dataclasses.asdict(event.stats), "healthy": event.healthy,
                "unhealthy_reason": event.unhealthy_reason,
                "warmup": None if event.warmup is None else dataclasses.asdict(event.warmup)}
    if isinstance(event, driver.Added):
        error = None if event.error is None else [type(event.error).__name__, str(event.error)]
        return {"ev": "added", "token": event.token, "error": error,
                "admitted": None if event.admitted is None else [admitted_to_wire(r) for r in event.admitted]}
    if isinstance(event, driver.StepFailed):
        return {"ev": "step_failed", "request_ids": event.request_ids, "message": event.message}
    return {"ev": "fatal", "message": event.message}


def event_from_wire(wire: dict) -> driver.Event:
    ev = wire["ev"]
    if ev == "outputs":
        return driver.Outputs(int(wire["step"]), EngineCoreOutputs.from_wire(wire["outputs"]))
    if ev == "stats":
        warmup = wire["warmup"]
        return driver.Stats(EngineStats(**wire["stats"]), None if warmup is None else WarmupStatus(**warmup),
                            bool(wire["healthy"]), str(wire["unhealthy_reason"]))
    if ev == "added":
        error = wire["error"]
        exc: BaseException | None = None
        if error is not None:  # ValueError: the request's fault (a 400); anything else the engine's
            exc = ValueError(error[1]) if error[0] == "ValueError" else RuntimeError(f"{error[0]}: {error[1]}")
        admitted = None if wire["admitted"] is None else [admitted_from_wire(r) for r in wire["admitted"]]
        return driver.Added(int(wire["token"]), admitted, exc)
    if ev == "step_failed":
        return driver.StepFailed(list(wire["request_ids"]), str(wire["message"]))
    if ev == "fatal":
        return driver.Fatal(str(wire["message"]))
    raise ValueError(f"unknown event {ev!r}")

