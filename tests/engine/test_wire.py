"""The engine core's messages between processes: every command and event survives the trip as
plain msgpack (no pickle), and a malformed frame is refused."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import numpy as np
import pytest

from zipage_jax.config import EngineConfig
from zipage_jax.engine import driver, wire
from zipage_jax.engine.core import AdmittedRequest, ModelInfo
from zipage_jax.engine.core_outputs import EngineCoreOutputs, FinishedSequence
from zipage_jax.engine.sequence import SequenceMetrics
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams, StructuredOutputsParams


def trip(message: dict) -> dict:
    """`message` as the other process reads it."""
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False, strict_map_key=False)


def outputs() -> EngineCoreOutputs:
    out = EngineCoreOutputs()
    out.add_tokens(np.array([3, 9], np.int64), np.array([17, 4], np.int32), None)
    out.add_tokens(np.array([3], np.int64), np.array([5], np.int32),
                   (np.array([-0.5], np.float32), np.arange(20, dtype=np.int32)[None], -np.ones((1, 20), np.float32)))
    out.finished.append(FinishedSequence(3, "stop", 11, True, SequenceMetrics(num_cached_prompt_tokens=32,
                                                                                 num_compressions=2)))
    out.failures.append(("req-1", "ValueError: nope", ValueError("nope")))
    out.prompt_logprobs.append((9, 1, np.array([-1.0, -2.0], np.float32), np.zeros((2, 20), np.int32),
                                np.zeros((2, 20), np.float32)))
    out.compressed.append(9)
    out.kv_tokens_evicted = 48
    return out


def test_core_outputs_cross_as_plain_data():
    sent = outputs()
    got = EngineCoreOutputs.from_wire(trip(sent.to_wire()))
    assert got.seq_ids.tolist() == [3, 9, 3] and got.token_ids.tolist() == [17, 4, 5]
    # logprobs of the tokens that had none are zeros; the ones given arrive as given
    assert got.logprobs.tolist() == [0.0, 0.0, -0.5] and got.top_ids[2].tolist() == list(range(20))
    assert got.finished == [FinishedSequence(3, "stop", 11, True, SequenceMetrics(num_cached_prompt_tokens=32,
                                                                                   num_compressions=2))]
    assert [(r, m) for r, m, _ in got.failures] == [("req-1", "ValueError: nope")]
    seq_id, first, lps, *_ = got.prompt_logprobs[0]
    assert (seq_id, first, lps.tolist()) == (9, 1, [-1.0, -2.0])
    assert got.compressed == [9] and got.kv_tokens_evicted == 48


def test_the_outputs_of_steps_in_a_row_merge_in_order():
    merged = EngineCoreOutputs(seq_ids=np.array([1], np.int64), token_ids=np.array([10], np.int32))
    merged.extend(outputs())
    merged.extend(EngineCoreOutputs(seq_ids=np.array([2], np.int64), token_ids=np.array([20], np.int32)))
    assert merged.seq_ids.tolist() == [1, 3, 9, 3, 2] and merged.token_ids.tolist() == [10, 17, 4, 5, 20]
    assert merged.logprobs.tolist() == [0.0, 0.0, 0.0, -0.5, 0.0] and merged.top_ids.shape == (5, 20)
    assert [f.seq_id for f in merged.finished] == [3] and merged.compressed == [9] and merged.kv_tokens_evicted == 48


def test_an_array_of_objects_is_refused():
    wire_outputs = outputs().to_wire()
    wire_outputs["token_ids"] = ["|O", [1], b"\0" * 8]
    with pytest.raises(ValueError, match="dtype"):
        EngineCoreOutputs.from_wire(trip(wire_outputs))


def test_commands_cross_and_are_validated_again():
    params = SamplingParams(temperature=0.5, top_k=7, stop=["x", "yz"], stop_token_ids=[2], max_tokens=9, n=2,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}), seed=3)
    add = driver.Add(4, [([1, 2, 3], params, "r"), ("text", None, None)])
    got = wire.command_from_wire(trip(wire.command_to_wire(add)))
    assert got == add
    for command in (driver.Abort("r"), driver.FinishSequences([1, 5]), driver.OutputLag(12), driver.StartWarmup(),
                    driver.Stop()):
        assert wire.command_from_wire(trip(wire.command_to_wire(command))) == command
    bad = wire.command_to_wire(add)
    bad["requests"][0][1]["temperature"] = -1.0  # the receiving side checks as a user's input is checked
    with pytest.raises(ValueError, match="temperature"):
        wire.command_from_wire(trip(bad))
    with pytest.raises(ValueError, match="unknown command"):
        wire.command_from_wire({"op": "exec"})


def test_events_cross():
    admitted = AdmittedRequest("r", None, [1, 2], SamplingParams(max_tokens=3), [7, 8])
    events = [driver.Added(1, [admitted]), driver.Outputs(5, EngineCoreOutputs()),
              driver.StepFailed(["a", "b"], "engine step failed"), driver.Fatal("gone"),
              driver.Stats(EngineStats(num_running=3, kv_usage=0.5), WarmupStatus(10, 4, True, False, 1.5, 0), False,
                           "rebuilding")]
    for event in events:
        got = wire.event_from_wire(trip(wire.event_to_wire(event)))
        if isinstance(event, driver.Outputs):
            assert got.step == 5 and got.outputs.empty
        else:
            assert got == event
    refused = wire.event_from_wire(trip(wire.event_to_wire(driver.Added(2, None, ValueError("prompt is empty")))))
    assert isinstance(refused.error, ValueError) and str(refused.error) == "prompt is empty"
    broken = wire.event_from_wire(trip(wire.event_to_wire(driver.Added(3, None, KeyError("x")))))
    assert isinstance(broken.error, RuntimeError) and "KeyError" in str(broken.error)


def test_config_and_model_info_cross():
    config = EngineConfig.from_options(model="random-qwen3-tiny", kvcache_block_size=16, max_cache_blocks_per_seq=4,
                                       decay_factor=0.5)
    assert wire.config_from_wire(trip(wire.config_to_wire(config))) == config
    info = ModelInfo(128, (2, 5), (0, 1, 2), 320, 16, 99, True, 8)
    assert wire.model_info_from_wire(trip(wire.model_info_to_wire(info))) == info


def test_channel_frames_and_limits():
    a, b = socket.socketpair()
    left, right = wire.Channel(a), wire.Channel(b)
    big = {"op": "x", "data": b"\1" * 3_000_000}  # over one recv
    threading.Thread(target=left.send, args=(big,)).start()
    assert right.recv() == big
    a.sendall(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(ValueError, match="over the limit"):
        right.recv()
    a2, b2 = socket.socketpair()
    data = msgpack.packb([1, 2])
    a2.sendall(struct.pack(">I", len(data)) + data)
    with pytest.raises(ValueError, match="must hold a map"):
        wire.Channel(b2).recv()
    a2.close()
    assert wire.Channel(b2).recv() is None  # the other end closed
    left.close()
    right.close()
