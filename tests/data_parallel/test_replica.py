"""EngineReplica in this process (no Ray): its stepping thread, add / poll / abort, the engine's
refusal, and a failed step ending the requests in flight with an error."""

from __future__ import annotations

import time

import pytest
from server_harness import ENGINE_OPTIONS

from zipage_jax.config import EngineConfig
from zipage_jax.data_parallel.replica import EngineReplica
from zipage_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(tiny_model_factory, model_cache_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    yield EngineReplica(EngineConfig(model=str(tiny_model_factory("qwen3")), **ENGINE_OPTIONS))
    mp.undo()


def collect(replica: EngineReplica, request_ids: set[str], timeout: float = 60) -> dict[str, list]:
    """Every output of the requests until each has finished."""
    outputs: dict[str, list] = {r: [] for r in request_ids}
    deadline = time.monotonic() + timeout
    while any(not (o and o[-1].finished) for o in outputs.values()):
        assert time.monotonic() < deadline, "the requests did not finish"
        for out in replica.poll(0.5).outputs:
            outputs[out.request_id].append(out)
    return outputs


def test_requests_run_on_the_replicas_own_thread_and_polls_bring_their_outputs(replica):
    info, status = replica.info(), replica.ping()
    assert info.block_size == ENGINE_OPTIONS["kvcache_block_size"] and info.max_model_len == 256
    assert info.num_kv_blocks == ENGINE_OPTIONS["num_kvcache_blocks"] - 1 and info.tokenizer is not None
    assert (status.pid, status.incarnation, status.warmup) == (info.pid, info.incarnation, None)
    replica.add([5, 6, 7, 8], GREEDY, "a")
    replica.add([9, 10, 11], GREEDY, "b")
    outputs = collect(replica, {"a", "b"})
    for request_outputs in outputs.values():
        final = request_outputs[-1].outputs[0]
        assert final.token_ids == [t for o in request_outputs for t in o.outputs[0].delta_token_ids]
        assert len(final.token_ids) == 6 and final.finish_reason == "length"
    poll = replica.poll(0.01)  # nothing new: it waits, then brings the stats alone
    assert poll.outputs == [] and poll.stats.generation_tokens >= 12 and poll.stats.num_running == 0


def test_the_engines_refusal_reaches_the_caller_and_an_abort_ends_a_request(replica):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        replica.add([5, 99999], GREEDY, "bad")
    replica.add([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "long")
    replica.abort("long")
    deadline, tokens = time.monotonic() + 30, 0
    while replica.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the aborted request still runs"
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in replica.poll(0.1).outputs)
    tokens += sum(len(o.outputs[0].delta_token_ids) for o in replica.poll(0).outputs)
    assert tokens < 200


def test_a_failed_step_ends_the_requests_in_flight_with_an_error(replica, monkeypatch):
    engine_step = replica.engine.step

    def fail_once():
        monkeypatch.setattr(replica.engine, "step", engine_step)
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(replica.engine, "step", fail_once)
    replica.add([5, 6, 7, 8], GREEDY, "doomed")
    outputs = collect(replica, {"doomed"})["doomed"]
    assert outputs[-1].error == "engine step failed" and outputs[-1].finished
    replica.add([5, 6, 7, 8], GREEDY, "after")  # the replica serves on
    assert collect(replica, {"after"})["after"][-1].outputs[0].finish_reason == "length"
