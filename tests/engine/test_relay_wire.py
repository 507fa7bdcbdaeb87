"""The step relay's codec (engine/runner/relay_wire.py): every relayed call's real arguments
round-trip, and every malformed input, random or crafted, is one RelayProtocolError."""

from __future__ import annotations

import socket

import msgpack
import numpy as np
import pytest
from relay_calls import assert_same_arguments, compaction_args, forward_args, relayed_calls

from zipage_jax.engine.runner.relay_wire import (
    HEADER_SIZE,
    MAX_FRAME,
    MAX_NDIM,
    RELAYED,
    Beat,
    Call,
    CheckIn,
    Failed,
    RelayProtocolError,
    Stop,
    decode,
    encode,
    frame,
    payload_size,
    read_message,
)


def _call_wire(method: str = "run_seed", args: tuple | None = None) -> dict:
    """A valid call as its msgpack map, to break one field of."""
    args = dict(relayed_calls())[method] if args is None else args
    return msgpack.unpackb(encode(Call(method, args)))


def _refused(wire: object, match: str) -> None:
    with pytest.raises(RelayProtocolError, match=match):
        decode(msgpack.packb(wire, use_bin_type=True))


@pytest.mark.parametrize("method, args", relayed_calls(), ids=[m for m, _ in relayed_calls()])
def test_every_relayed_call_round_trips_with_its_real_argument_types(method, args):
    message = decode(encode(Call(method, args)))
    assert isinstance(message, Call) and message.method == method
    assert_same_arguments(message.args, args)


def test_the_schema_covers_exactly_the_relayed_calls():
    assert {method for method, _ in relayed_calls()} == RELAYED == {
        "run_forward", "run_compaction", "run_seed", "reset_state", "prefetch_decode"}


def test_the_other_messages_round_trip():
    signature = {"max_num_seqs": "8", "model config": "model(2 layers)"}
    for message in (CheckIn(3, signature), Failed("run_forward: RuntimeError: boom"), Beat(), Stop()):
        assert decode(encode(message)) == message


def test_frames_carry_their_length_and_a_closed_connection_is_eof():
    a, b = socket.socketpair()
    with a, b:
        data = frame(Call("run_forward", forward_args()))
        assert payload_size(data[:HEADER_SIZE]) == len(data) - HEADER_SIZE
        a.sendall(data + frame(Beat()))
        assert_same_arguments(read_message(b).args, forward_args())
        assert read_message(b) == Beat()
        a.sendall(data[:-3])  # a frame cut short
        a.close()
        with pytest.raises(EOFError):
            read_message(b)


def test_a_huge_declared_length_is_refused_before_its_payload_is_read():
    for size in (MAX_FRAME + 1, 2**32 - 1):
        with pytest.raises(RelayProtocolError, match="over the limit"):
            payload_size(size.to_bytes(HEADER_SIZE, "big"))
    assert payload_size(MAX_FRAME.to_bytes(HEADER_SIZE, "big")) == MAX_FRAME  # control: the limit itself is fine
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\xff\xff\xff\xff")  # and nothing after: reading the payload would block
        b.settimeout(5)
        with pytest.raises(RelayProtocolError, match="over the limit"):
            read_message(b)


def test_random_bytes_are_one_error_type():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        payload = rng.bytes(int(rng.integers(0, 64)))
        with pytest.raises(RelayProtocolError):
            decode(payload)


def test_every_truncation_of_a_call_is_refused():
    payload = encode(Call("run_forward", forward_args(rows=1, chunk=2)))
    for cut in range(len(payload)):
        with pytest.raises(RelayProtocolError):
            decode(payload[:cut])
    assert isinstance(decode(payload), Call)  # control: the whole payload decodes


def test_corrupted_calls_decode_or_raise_the_one_error_type():
    rng = np.random.default_rng(1)
    payloads = [encode(Call(m, a)) for m, a in relayed_calls()]
    refused = 0
    for _ in range(3000):
        data = bytearray(payloads[int(rng.integers(len(payloads)))])
        for i in rng.integers(0, len(data), int(rng.integers(1, 4))):
            data[i] = int(rng.integers(256))
        try:
            decode(bytes(data))
        except RelayProtocolError:
            refused += 1
    assert refused > 0


@pytest.mark.parametrize("method", ["__init__", "pickle", "", 5, None, ["run_seed"]])
def test_an_unknown_method_is_refused(method):
    _refused({**_call_wire(), "method": method}, "is not a relayed runner call")


def test_encoding_refuses_what_the_schema_does_not_hold():
    with pytest.raises(RelayProtocolError, match="not a relayed runner call"):
        encode(Call("__init__", ()))
    with pytest.raises(RelayProtocolError, match="takes 2 arguments"):
        encode(Call("run_compaction", compaction_args()[:1]))
    with pytest.raises(RelayProtocolError, match="dtype"):
        encode(Call("run_seed", (("tokens", 8), np.array([object()]), np.zeros(1), np.zeros(1))))
    with pytest.raises(RelayProtocolError, match="program key"):
        encode(Call("run_seed", (("tokens", 8.5), *dict(relayed_calls())["run_seed"][1:])))


def _with_array(wire: dict, index: int, **changes) -> dict:
    args = list(wire["args"])
    args[index] = {**args[index], **changes}
    return {**wire, "args": args}


@pytest.mark.parametrize("dtype", ["object", "complex64", "<i4", "str", "V8", "", 4, None])
def test_an_array_of_a_dtype_outside_the_allowed_set_is_refused(dtype):
    _refused(_with_array(_call_wire(), 1, dtype=dtype), "dtype")


@pytest.mark.parametrize("shape", [[-1], [1.0], [True], [1] * (MAX_NDIM + 1), "1", None])
def test_a_malformed_shape_is_refused(shape):
    _refused(_with_array(_call_wire(), 1, shape=shape), "shape")


def test_wrong_byte_counts_and_non_bytes_data_are_refused():
    wire = _call_wire()
    _refused(_with_array(wire, 2, data=b""), "0 bytes for a int32\\[1, 8\\] array of 32")
    _refused(_with_array(wire, 1, shape=[2]), "4 bytes for a int32\\[2\\] array of 8")
    _refused(_with_array(wire, 2, data=b"\x00" * 33), "33 bytes")
    _refused(_with_array(wire, 2, data="text"), "data must be a bytes")
    _refused(_with_array(wire, 2, extra=1), "must have the fields")
    _refused({**wire, "args": [*wire["args"][:3], 7]}, "must be a dict")


def test_a_bool_array_holds_only_zeros_and_ones():
    wire = _call_wire("run_forward")
    sampling = wire["args"][2]
    assert sampling["reset"]["dtype"] == "bool"
    bad = {**sampling, "reset": {**sampling["reset"], "data": b"\x02" + sampling["reset"]["data"][1:]}}
    _refused({**wire, "args": [*wire["args"][:2], bad, wire["args"][3]]}, "bool array")


def test_structs_are_rebuilt_by_field_name_and_need_every_field():
    wire = _call_wire("run_forward")
    inputs = wire["args"][1]
    reordered = dict(reversed(list(inputs.items())))
    message = decode(msgpack.packb({**wire, "args": [wire["args"][0], reordered, *wire["args"][2:]]}))
    np.testing.assert_array_equal(message.args[1].tokens, forward_args()[1].tokens)  # by name, not position
    missing = {k: v for k, v in inputs.items() if k != "kv_lens"}
    _refused({**wire, "args": [wire["args"][0], missing, *wire["args"][2:]]}, "StepInputs")
    _refused({**wire, "args": [wire["args"][0], [*inputs.values()], *wire["args"][2:]]}, "must be a dict")


@pytest.mark.parametrize("key", [[1.5], [["nested"]], [None], ["x" * 65], list(range(9)), "prefill rows", {}])
def test_a_program_key_is_a_short_list_of_str_and_int(key):
    _refused({**_call_wire(), "args": [key, *_call_wire()["args"][1:]]}, "program key|argument 0")


def test_argument_counts_counts_and_message_shapes_are_checked():
    _refused({**_call_wire(), "args": _call_wire()["args"][:3]}, "takes 4 arguments, got 3")
    _refused({"type": "call", "method": "prefetch_decode", "args": [-1]}, "must be an int")
    _refused({"type": "call", "method": "prefetch_decode", "args": [True]}, "must be an int")
    _refused({"type": "call", "method": "reset_state", "args": [], "more": 1}, "must have the fields")
    _refused({"type": "pickle"}, "unknown message type")
    _refused({}, "unknown message type")
    _refused([1, 2], "must be a map")
    _refused({"type": "beat", "why": "x"}, "must have the fields")
    _refused({"type": "failed", "why": b"bytes"}, "must be a str")
    _refused({"type": "check-in", "process_id": -1, "signature": {}}, "process id")
    _refused({"type": "check-in", "process_id": 1, "signature": {"a": 1}}, "signature")
    _refused({"type": "check-in", "process_id": 1, "signature": {b"a": "1"}}, "signature")
    with pytest.raises(RelayProtocolError, match="msgpack"):
        decode(msgpack.packb({"type": "beat"}) + b"\x00")  # trailing bytes
    _refused(msgpack.ExtType(1, b"x"), "must be a map")
    _refused({**_call_wire(), "args": [*_call_wire()["args"][:3], msgpack.ExtType(1, b"x")]}, "must be a dict")
