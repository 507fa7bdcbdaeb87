"""Stop strings are matched by the output stage, outside the engine's step: a sequence with stop
strings decodes only while that stage is at most MAX_OUTPUT_LAG steps behind, so it ends within
that many steps (and an asynchronous step's token) past its stop string."""

from __future__ import annotations

import pytest

from zipage_jax import SamplingParams
from zipage_jax.engine.core import EngineCore
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.scheduler import MAX_OUTPUT_LAG

OPTIONS = dict(model="random-qwen3-tiny", kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4,
               max_model_len=256)


@pytest.fixture(scope="module")
def core():
    return EngineCore(**OPTIONS)


def tokens_of(core: EngineCore, request_id: str) -> int:
    return core.requests[request_id].seqs[0].num_tokens


def test_a_lagging_output_stage_holds_the_sequences_with_stop_strings_only(core):
    held = core.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=60, stop=["never"])).request_id
    free = core.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=60)).request_id
    for _ in range(3):  # both decode while the stage keeps up
        core.step()
    before = {r: tokens_of(core, r) for r in (held, free)}
    core.set_output_lag(MAX_OUTPUT_LAG)  # still within the bound
    core.step()
    assert tokens_of(core, held) == before[held] + 1
    core.set_output_lag(MAX_OUTPUT_LAG + 1)
    mid = {r: tokens_of(core, r) for r in (held, free)}
    for _ in range(4):
        core.step()
    assert tokens_of(core, held) == mid[held]  # waits for the output stage
    assert tokens_of(core, free) == mid[free] + 4
    core.set_output_lag(0)
    core.step()
    core.step()
    assert tokens_of(core, held) > mid[held]
    for request_id in (held, free):
        core.abort(request_id)
    while core.has_unfinished_requests():
        core.step()


def test_in_process_a_stop_string_costs_at_most_one_token_of_an_asynchronous_step():
    engine = LLMEngine(**OPTIONS)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    request_id = engine.add_request([9, 8, 7], plain)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text or text
    # a stop string the same greedy output reaches first some tokens in
    at = next(i for i in range(20, len(text) - 8) if text.find(text[i:i + 8]) == i)
    stop = text[at:at + 8]
    computed = []
    finish = engine.core.finish_sequences

    def record(seq_ids):
        computed.extend(engine.core._request_of[s].seqs[0].num_tokens for s in seq_ids)
        finish(seq_ids)

    engine.core.finish_sequences = record
    engine.add_request([9, 8, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       request_id="stopped")
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.outputs[0].text == text[:at] and final.outputs[0].stop_reason == stop
    # the core had computed the stop's last token and at most one more (the step in flight)
    shown = 3 + len(final.outputs[0].token_ids)
    assert len(computed) == 1 and shown <= computed[0] <= shown + 1
    assert request_id != "stopped"
