"""The step relay's messages (step_relay.py) as frames of a fixed schema; nothing is pickled.

A frame is a 4-byte big-endian length, at most MAX_FRAME, and a msgpack map whose "type" says
which message it holds:

- "call" (process 0 to a follower): a runner method of RELAYED and its host arguments by that
  method's schema: a program key (a tuple of at most MAX_KEY_ITEMS str or int), numpy arrays as
  {dtype, shape, data} (a dtype of DTYPES, at most MAX_NDIM dimensions, exactly
  prod(shape) * itemsize little-endian bytes), and the step's NamedTuples and dataclasses
  (StepInputs, SamplingBatch, CompactionTables) as maps of their fields' arrays, by name;
- "stop" (process 0 stops cleanly), "check-in" (a follower's process id and runner signature),
  "beat" (a follower's heartbeat), "failed" (a follower's call raised: why).

`decode` is pure and raises RelayProtocolError, with a message saying what is wrong, for every
malformed input; `encode` raises it for a message outside the schema.
"""

from __future__ import annotations

import dataclasses
import math
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import numpy as np

from zipage_jax.engine.runner.compaction import CompactionTables
from zipage_jax.layers.paged_attention import StepInputs
from zipage_jax.layers.sampler import SamplingBatch

MAX_FRAME = 1 << 28  # bytes of one message: a step's arrays are a few MiB at most
MAX_NDIM = 4
MAX_KEY_ITEMS = 8
MAX_KEY_STR = 64
MAX_COUNT = 1 << 31
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64"})
_LENGTH = struct.Struct(">I")
HEADER_SIZE = _LENGTH.size


class RelayProtocolError(ValueError):
    """A relay message that is not one: malformed, oversized, or outside the schema."""


@dataclasses.dataclass(frozen=True)
class Call:
    method: str  # one of RELAYED
    args: tuple


@dataclasses.dataclass(frozen=True)
class CheckIn:
    process_id: int
    signature: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Failed:
    why: str


@dataclasses.dataclass(frozen=True)
class Beat:
    pass


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


Message = Call | CheckIn | Failed | Beat | Stop


# -- one argument's schema ----------------------------------------------------------------------


class _Schema(NamedTuple):
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any, str], Any]  # (wire value, what it is: for the error message)


def _key_to_wire(key: tuple) -> list:
    if not isinstance(key, tuple) or not all(_is_int(k) or isinstance(k, str) for k in key):
        raise RelayProtocolError(f"a program key must be a tuple of str and int, got {key!r}")
    return list(key)


def _key_from_wire(value: Any, what: str) -> tuple:
    items = _expect(value, list, what)
    if len(items) > MAX_KEY_ITEMS:
        raise RelayProtocolError(f"{what} has {len(items)} items, over the limit of {MAX_KEY_ITEMS}")
    for item in items:
        if not (_is_int(item) or isinstance(item, str) and len(item) <= MAX_KEY_STR):
            raise RelayProtocolError(f"{what} holds {item!r}: only int and str (at most {MAX_KEY_STR} characters)")
    return tuple(items)


def _count_to_wire(n: int) -> int:
    return _count_from_wire(n, "a count")


def _count_from_wire(value: Any, what: str) -> int:
    if not _is_int(value) or not 0 <= value < MAX_COUNT:
        raise RelayProtocolError(f"{what} must be an int in [0, {MAX_COUNT}), got {value!r}")
    return value


def _array_to_wire(array: Any) -> dict:
    array = np.asarray(array)
    if array.dtype.name not in DTYPES or array.ndim > MAX_NDIM:
        raise RelayProtocolError(f"an array must be {MAX_NDIM}-d at most of a dtype in {sorted(DTYPES)}, "
                                 f"got {array.dtype.name}{list(array.shape)}")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": data}


def _array_from_wire(value: Any, what: str) -> np.ndarray:
    fields = _map(value, ("dtype", "shape", "data"), what)
    dtype_name = fields["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise RelayProtocolError(f"{what}: dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    shape = _expect(fields["shape"], list, f"{what}'s shape")
    if len(shape) > MAX_NDIM or not all(_is_int(d) and 0 <= d < MAX_FRAME for d in shape):
        raise RelayProtocolError(f"{what}: shape {shape!r} is not {MAX_NDIM} dimensions at most of sizes >= 0")
    data = _expect(fields["data"], bytes, f"{what}'s data")
    dtype = np.dtype(dtype_name).newbyteorder("<")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise RelayProtocolError(f"{what}: {len(data)} bytes for a {dtype_name}{shape} array of {expected}")
    if dtype_name == "bool" and data.translate(None, b"\x00\x01"):
        raise RelayProtocolError(f"{what}: a bool array holds bytes other than 0 and 1")
    return np.frombuffer(data, dtype).reshape(shape)


def _struct(cls: type) -> _Schema:
    """A NamedTuple or dataclass of arrays, as the map of its fields."""
    names = cls._fields if hasattr(cls, "_fields") else tuple(f.name for f in dataclasses.fields(cls))

    def to_wire(value: Any) -> dict:
        if not isinstance(value, cls):
            raise RelayProtocolError(f"expected a {cls.__name__}, got {type(value).__name__}")
        return {name: _array_to_wire(getattr(value, name)) for name in names}

    def from_wire(value: Any, what: str) -> Any:
        fields = _map(value, names, f"{what} ({cls.__name__})")
        return cls(**{name: _array_from_wire(fields[name], f"{what}.{name}") for name in names})

    return _Schema(to_wire, from_wire)


_KEY = _Schema(_key_to_wire, _key_from_wire)
_ARRAY = _Schema(_array_to_wire, _array_from_wire)
ARGUMENTS: dict[str, tuple[_Schema, ...]] = {  # each relayed method's arguments, in order
    "run_forward": (_KEY, _struct(StepInputs), _struct(SamplingBatch), _ARRAY),
    "run_compaction": (_KEY, _struct(CompactionTables)),
    "run_seed": (_KEY, _ARRAY, _ARRAY, _ARRAY),
    "reset_state": (),
    "prefetch_decode": (_Schema(_count_to_wire, _count_from_wire),),
}
RELAYED = frozenset(ARGUMENTS)


# -- messages ----------------------------------------------------------------------------------


def encode(message: Message) -> bytes:
    """The msgpack payload of `message` (frame() adds the length)."""
    if isinstance(message, Call):
        schema = _call_schema(message.method)
        if len(message.args) != len(schema):
            raise RelayProtocolError(f"{message.method} takes {len(schema)} arguments, got {len(message.args)}")
        wire: dict = {"type": "call", "method": message.method,
                      "args": [s.to_wire(a) for s, a in zip(schema, message.args)]}
    elif isinstance(message, CheckIn):
        wire = {"type": "check-in", "process_id": message.process_id, "signature": dict(message.signature)}
    elif isinstance(message, Failed):
        wire = {"type": "failed", "why": message.why}
    else:
        wire = {"type": "beat" if isinstance(message, Beat) else "stop"}
    return msgpack.packb(wire, use_bin_type=True)


def frame(message: Message) -> bytes:
    payload = encode(message)
    if len(payload) > MAX_FRAME:
        raise RelayProtocolError(f"a message of {len(payload)} bytes is over the limit of {MAX_FRAME}")
    return _LENGTH.pack(len(payload)) + payload


def payload_size(header: bytes) -> int:
    """The payload's length a frame's header declares, checked against MAX_FRAME."""
    if len(header) != HEADER_SIZE:
        raise RelayProtocolError(f"a frame header is {HEADER_SIZE} bytes, got {len(header)}")
    (size,) = _LENGTH.unpack(header)
    if size > MAX_FRAME:
        raise RelayProtocolError(f"a frame of {size} bytes is over the limit of {MAX_FRAME}")
    return size


def decode(payload: bytes) -> Message:
    """The message a frame's payload holds; RelayProtocolError for anything else."""
    try:
        wire = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise RelayProtocolError(f"not a msgpack message ({type(exc).__name__}: {exc})") from exc
    if not isinstance(wire, dict):
        raise RelayProtocolError(f"a message must be a map, got {type(wire).__name__}")
    kind = wire.get("type")
    try:
        return _from_wire(kind, wire)
    except RelayProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - the schema's checks should leave none: say what it was
        raise RelayProtocolError(f"a malformed {kind!r} message ({type(exc).__name__}: {exc})") from exc


def _from_wire(kind: Any, wire: dict) -> Message:
    if kind == "call":
        fields = _map(wire, ("type", "method", "args"), "a call")
        method = fields["method"]
        schema = _call_schema(method)
        args = _expect(fields["args"], list, f"{method}'s arguments")
        if len(args) != len(schema):
            raise RelayProtocolError(f"{method} takes {len(schema)} arguments, got {len(args)}")
        return Call(method, tuple(s.from_wire(a, f"{method} argument {i}")
                                  for i, (s, a) in enumerate(zip(schema, args))))
    if kind == "check-in":
        fields = _map(wire, ("type", "process_id", "signature"), "a check-in")
        signature = _expect(fields["signature"], dict, "a check-in's signature")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in signature.items()):
            raise RelayProtocolError("a check-in's signature must map str to str")
        return CheckIn(_count_from_wire(fields["process_id"], "a check-in's process id"), signature)
    if kind == "failed":
        return Failed(_expect(_map(wire, ("type", "why"), "a failure")["why"], str, "a failure's reason"))
    if kind in ("beat", "stop"):
        _map(wire, ("type",), f"a {kind}")
        return Beat() if kind == "beat" else Stop()
    raise RelayProtocolError(f"unknown message type {kind!r}")


def _call_schema(method: Any) -> tuple[_Schema, ...]:
    if not isinstance(method, str) or method not in ARGUMENTS:
        raise RelayProtocolError(f"{method!r} is not a relayed runner call (one of {', '.join(sorted(RELAYED))})")
    return ARGUMENTS[method]


def _map(value: Any, keys: tuple[str, ...], what: str) -> dict:
    """`value` as a map with exactly `keys`."""
    fields = _expect(value, dict, what)
    if fields.keys() != set(keys):
        raise RelayProtocolError(f"{what} must have the fields {sorted(keys)}, got {sorted(map(str, fields))}")
    return fields


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise RelayProtocolError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- over a socket ------------------------------------------------------------------------------


def read_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """`size` bytes; EOFError when the peer closes first, TimeoutError when they have not all
    arrived by `deadline` (time.monotonic(); None waits for ever). `sock` is blocking."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    poller = None if deadline is None else select.poll()
    if poller is not None:
        poller.register(sock, select.POLLIN)
    while received < size:
        if poller is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError(f"{size - received} of {size} bytes had not arrived in time")
        n = sock.recv_into(view[received:])
        if n == 0:
            raise EOFError("the connection closed")
        received += n
    return bytes(buffer)


def read_message(sock: socket.socket, deadline: float | None = None) -> Message:
    """The next message; EOFError / TimeoutError as read_exactly, RelayProtocolError for a
    malformed or oversized frame (its payload is not read)."""
    size = payload_size(read_exactly(sock, HEADER_SIZE, deadline))
    return decode(read_exactly(sock, size, deadline))
