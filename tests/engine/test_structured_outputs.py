"""Structured outputs on a tiny random Llama: every output fits its JSON schema (checked with
jsonschema_rs), regex (python re) or choice, through async scheduling, compression, the prefix
cache and n > 1; bad grammars are refused at admission; a constrained request compiles nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import jsonschema_rs
import numpy as np
import pytest

from zipage_jax import LLM, SamplingParams, StructuredOutputsParams
from zipage_jax.engine.grammar import GrammarCompiler
from zipage_jax.layers.sampler import mask_words

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=320)
EOS = 2  # the tiny tokenizer's <|im_end|>

# bounded everywhere (lengths, items, ranges, no extra properties), so a random model ends in time
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "owner"],
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                  "minItems": 1, "maxItems": 3},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
                                   "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}}}}
POINTS = {"type": "array", "minItems": 2, "maxItems": 4,
          "items": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                   "y": {"enum": ["up", "down"]}}}}
SCHEMAS = [PERSON, NESTED, POINTS]
REGEXES = [r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no)(, (yes|no)){0,3}"]
CHOICES = ["red", "green", "blue", 'say "hi"']
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64], [300, 1, 2, 3], [7] * 23, [200, 201]]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), **OPTIONS)


def constrained(max_tokens: int = 160, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec))


def check_json(out: dict, schema: dict) -> None:
    assert out["finish_reason"] == "stop", out
    jsonschema_rs.validate(schema, json.loads(out["text"]))


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, json_object"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="got json, choice"):
        StructuredOutputsParams(json=PERSON, choice=["a"])
    for bad in [dict(choice=[]), dict(choice="ab"), dict(choice=["a", 1]), dict(json=3), dict(json_object=1)]:
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "no-such-type"),
    (dict(json='{"type": "object"'), "not a JSON schema"),
    (dict(regex="a(("), "unclosed group"),
    (dict(grammar="start: missing_rule"), "unknown name"),
    (dict(choice=["a", "b"]), None),  # positive control: a valid one is admitted
])
def test_a_bad_grammar_is_refused_at_admission(llm, spec, message):
    engine = llm.engine
    before = dict(engine.core.requests)
    if message is None:
        request_id = engine.add_request(PROMPTS[1], constrained(**spec))
        assert request_id in engine.core.requests
        engine.abort(request_id)
        return
    with pytest.raises(ValueError, match=message):
        engine.add_request(PROMPTS[1], constrained(**spec))
    assert engine.core.requests == before and not engine.has_unfinished_requests()


def test_greedy_outputs_fit_schemas_regexes_and_choices(llm):
    specs = [dict(json=s) for s in SCHEMAS] + [dict(regex=r) for r in REGEXES] + [dict(choice=CHOICES)]
    params = [constrained(**spec) for spec in specs]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(specs))], params, use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS):
        check_json(out, schema)
    for out, regex in zip(outs[len(SCHEMAS):], REGEXES):
        assert out["finish_reason"] == "stop" and re.fullmatch(regex, out["text"]), out
    assert outs[-1]["finish_reason"] == "stop" and outs[-1]["text"] in CHOICES


def test_json_object_and_a_lark_grammar(llm):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"'
    outs = llm.generate(PROMPTS[:2], [constrained(max_tokens=200, json_object=True), constrained(grammar=lark)],
                        use_tqdm=False)
    if outs[0]["finish_reason"] == "stop":  # a random model may nest objects past max_tokens
        assert isinstance(json.loads(outs[0]["text"]), dict)
    else:
        assert outs[0]["finish_reason"] == "length" and outs[0]["text"].startswith("{")
    assert outs[1]["finish_reason"] == "stop" and re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x))*\)",
                                                                 outs[1]["text"]), outs[1]


def test_sampled_n_completions_each_fit_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(json=NESTED))
    first = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    texts = [o["text"] for o in first["outputs"]]
    for o in first["outputs"]:
        check_json(o, NESTED)
    assert len(set(texts)) > 1
    again = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [o["text"] for o in again["outputs"]] == texts


def test_an_unconstrained_request_is_unchanged_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], free, use_tqdm=False)[0]["token_ids"]
    outs = llm.generate(PROMPTS[:3], [constrained(json=PERSON), free, constrained(regex=REGEXES[0])],
                        use_tqdm=False)
    assert outs[1]["token_ids"] == alone
    check_json(outs[0], PERSON)


@pytest.mark.slow  # a second engine: its compiles
def test_async_scheduling_gives_the_same_constrained_tokens(llama_dir, llm):
    def workload(engine_llm):
        params = [constrained(json=PERSON), SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
                  constrained(regex=REGEXES[1]), constrained(json=POINTS)]
        return [o["token_ids"] for o in engine_llm.generate(PROMPTS, params, use_tqdm=False)]

    assert llm.engine.config.async_scheduling
    sync = LLM(str(llama_dir), async_scheduling=False, **OPTIONS)
    assert workload(llm) == workload(sync)


def test_only_a_constrained_token_in_flight_is_read_before_scheduling(llm, monkeypatch):
    """Unconstrained steps keep the overlap (step N is read after step N + 1 is dispatched); a
    constrained sequence's step is read before the next one is scheduled."""
    engine, events = llm.engine, []
    for obj, name in ((engine.core.scheduler, "schedule"), (engine.core.runner, "_fetch")):
        original = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, _f=original, _n=name: events.append(_n) or _f(*a))

    def order(params: SamplingParams) -> list[str]:
        events.clear()
        llm.generate([PROMPTS[1]], params, use_tqdm=False)
        return events[:5]  # three steps: prefill, then two decodes

    assert order(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == [
        "schedule", "schedule", "_fetch", "schedule", "_fetch"]
    assert order(constrained(regex="[a-z]{8}")) == ["schedule", "_fetch", "schedule", "_fetch", "schedule"]


def test_without_reading_the_step_in_flight_a_mask_is_never_built(llm, monkeypatch, caplog):
    """Positive control of the test above: a step that would mask with a matcher a token behind
    is refused (the step fails; the engine recovers, the sequence computes its tokens again)."""
    from zipage_jax.engine.runner import model_runner

    @dataclasses.dataclass
    class Unread(model_runner._InFlight):  # the runner forgets that a constrained row sampled
        def __post_init__(self):
            self.constrained = False

    engine = llm.engine
    recoveries = engine.stats.num_recoveries
    finals = []
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR, logger="zipage_jax"):
        m.setattr(model_runner, "_InFlight", Unread)
        engine.add_request(PROMPTS[0], constrained(regex=REGEXES[1]))
        for _ in range(10):
            finals += [o for o in engine.step() if o.finished]
            if engine.stats.num_recoveries > recoveries:
                break
    assert engine.stats.num_recoveries == recoveries + 1 and finals == []
    assert "a structured output's mask needs its last token, still on the device" in caplog.text
    while engine.has_unfinished_requests():  # read in time again: it completes
        finals += [o for o in engine.step() if o.finished]
    [out] = finals
    assert out.outputs[0].finish_reason == "stop" and re.fullmatch(REGEXES[1], out.outputs[0].text)


@pytest.mark.slow  # a second engine: its compiles
def test_compression_during_the_output(llama_dir):
    small = LLM(str(llama_dir), max_cache_blocks_per_seq=2, query_cache_len=4, **OPTIONS)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=NESTED))
    outs = small.generate([list(range(20, 40)), PROMPTS[0]], [constrained(max_tokens=200, json=NESTED), params],
                          use_tqdm=False)
    completions = [outs[0]] + outs[1]["outputs"]
    for out in completions:
        check_json(out, NESTED)
    # a budget of 32 tokens, passed during the output
    assert all(out["metrics"]["num_compressions"] > 0 for out in completions)


def test_two_requests_with_the_same_prompt_share_its_cached_blocks(llm):
    prompt = list(range(20, 20 + 40))  # two full blocks the second request finds cached
    outs = [llm.generate([prompt], constrained(json=NESTED), use_tqdm=False)[0] for _ in range(2)]
    for out in outs:
        check_json(out, NESTED)
    assert outs[1]["metrics"]["cached_prompt_tokens"] == 32 and outs[1]["token_ids"] == outs[0]["token_ids"]


def test_eos_only_where_the_grammar_accepts_and_a_refused_token_fails_its_request_alone(llm):
    a = llm.tokenizer.convert_tokens_to_ids("a")

    def forced(tokens):
        return SamplingParams(temperature=0, max_tokens=8, forced_token_ids=tokens,
                              structured_outputs=StructuredOutputsParams(regex="[a-z]{1,3}"))

    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], free, use_tqdm=False)[0]["token_ids"]
    engine = llm.engine
    ids = [engine.add_request(PROMPTS[0], forced([a, EOS])), engine.add_request(PROMPTS[1], forced([EOS])),
           engine.add_request(PROMPTS[2], free)]
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    ended, refused, other = (finals[i] for i in ids)
    assert ended.outputs[0].finish_reason == "stop" and ended.outputs[0].text == "a"
    assert refused.outputs[0].finish_reason == "error" and "TokenRejected" in refused.error
    assert other.error is None and other.outputs[0].token_ids == alone


def test_a_constrained_request_compiles_nothing(llama_dir):
    fresh = LLM(str(llama_dir), **OPTIONS)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    fresh.generate([PROMPTS[0]], free, use_tqdm=False)  # decode rows 1, prefill rows 1
    fresh.generate(PROMPTS[:2], free, use_tqdm=False)  # decode rows 2, prefill rows 2
    compiled = fresh.engine.core.runner.num_compiles
    outs = fresh.generate(PROMPTS[:2], [constrained(json=PERSON), constrained(choice=CHOICES)], use_tqdm=False)
    outs += fresh.generate([PROMPTS[3]], constrained(regex=REGEXES[0]), use_tqdm=False)
    check_json(outs[0], PERSON)
    assert fresh.engine.core.runner.num_compiles == compiled
    fresh.generate(PROMPTS[:3], [constrained(json=PERSON)] * 3, use_tqdm=False)  # positive control: 4 rows
    assert fresh.engine.core.runner.num_compiles > compiled


def test_masks_follow_the_grammar_and_ban_ids_past_the_vocabularies(llm):
    """Each step's mask, against an independent reference: the tokens whose text keeps the output
    a prefix of [a-z]{0,3}, and EOS where it matches [a-z]{1,3}; none past the model's or the
    tokenizer's vocabulary (a model of 400 ids, then of 300, with this tokenizer of 320 tokens)."""
    tok = llm.tokenizer
    pieces = [tok.decode([t]) if t not in tok.all_special_ids else None for t in range(len(tok))]
    for vocab in (400, 300):
        compiler = GrammarCompiler(tok, vocab, [EOS])
        [grammar] = compiler.compile(StructuredOutputsParams(regex="[a-z]{1,3}"), 1)
        text, complete = "", []
        for _ in range(3):
            allowed = np.full((3, mask_words(vocab)), -1, np.int32)
            compiler.fill(allowed, [(1, grammar)])
            bits = np.unpackbits(allowed.view(np.uint8), axis=-1, bitorder="little").astype(bool)
            want = {t for t, p in enumerate(pieces[:min(vocab, len(tok))])
                    if p and re.fullmatch("[a-z]{0,3}", text + p)} | ({EOS} if text else set())
            assert set(np.flatnonzero(bits[1]).tolist()) == want
            assert bits[0].all() and bits[2].all()  # rows not filled stay unconstrained
            token = min(t for t in want if t != EOS)  # a single letter: three steps fit
            complete.append(grammar.accept(token))
            text += pieces[token]
        assert text == "aaa" and complete == [False, False, True]
