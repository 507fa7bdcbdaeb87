"""Prompt log-probabilities through the server: /v1/completions with echo and logprobs (also
max_tokens 0, lm-eval's log-likelihood form) and vLLM's prompt_logprobs, checked against the
engine's offline teacher-forced path (forced_token_ids) to 1e-4."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import COMPLETIONS, ENGINE_OPTIONS, MODEL

from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.sampling_params import SamplingParams

TOP = 2


@pytest.fixture(scope="module")
def forced(tiny_model_factory):
    """prompt ids -> the offline engine's teacher-forced (logprob, top ids) of prompt[1:]."""
    engine = LLMEngine(model=str(tiny_model_factory("qwen3")), **ENGINE_OPTIONS)

    def run(prompt: list[int]) -> list[tuple[float, list[int]]]:
        params = SamplingParams(max_tokens=len(prompt) - 1, logprobs=TOP, temperature=0, ignore_eos=True,
                                forced_token_ids=prompt[1:])
        engine.add_request(prompt[:1], params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        return [(lp.logprob, lp.top) for lp in outputs[0].outputs[0].logprobs]

    return run


def post(server, **body) -> dict:
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tok_text(server, token_id: int) -> str:
    return server.app.state.engine_client.tokenizer.decode([token_id])


def tokens_of(server, text: str) -> list[int]:
    return server.app.state.engine_client.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_logprobs_are_the_teacher_forced_ones(server, forced, max_tokens):
    prompts = ["The quick brown fox jumps", "over the lazy dog, twice over"]
    out = post(server, prompt=prompts, echo=True, logprobs=TOP, max_tokens=max_tokens, ignore_eos=True)
    for text, choice in zip(prompts, out["choices"]):
        ids = tokens_of(server, text)
        lp = choice["logprobs"]
        assert choice["text"].startswith(text)
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = forced(ids)
        for got, top, (want, want_top) in zip(lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:len(ids)],
                                             expected):
            assert got == pytest.approx(want, abs=1e-4)
            # keyed by token text: two ids may decode to the same text (a partial UTF-8 byte)
            assert sorted(top.values()) == pytest.approx(sorted({tok_text(server, t): v for t, v in want_top}.values()),
                                                         abs=1e-4)
        assert lp["tokens"][:len(ids)] == [server.app.state.engine_client.tokenizer.decode([t]) for t in ids]
        assert lp["text_offset"][0] == 0
    if max_tokens == 0:
        assert [c["text"] for c in out["choices"]] == prompts and out["usage"]["completion_tokens"] == 0
        assert all(c["finish_reason"] == "length" for c in out["choices"])


def test_token_prompts_echo_their_decoded_text(server, forced):
    ids = tokens_of(server, "Token prompts are decoded for echo")
    out = post(server, prompt=[ids], echo=True, logprobs=1, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == server.app.state.engine_client.tokenizer.decode(ids)
    expected = [want for want, _ in forced(ids)]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


def test_vllm_prompt_logprobs_name_each_prompt_token(server, forced):
    ids = tokens_of(server, "prompt logprobs in vLLM's shape")
    out = post(server, prompt=ids, max_tokens=2, prompt_logprobs=TOP)
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry, (want, want_top) in zip(ids[1:], entries[1:], forced(ids)):
        assert entry[str(token)]["logprob"] == pytest.approx(want, abs=1e-4)
        assert {t: e["rank"] for t, e in entry.items() if e["rank"] is not None} == {
            str(t): rank for rank, (t, _) in enumerate(want_top, 1)}
    assert "prompt_logprobs" not in post(server, prompt=ids, max_tokens=2)["choices"][0]


def test_streamed_echo_starts_with_the_prompt(server):
    text = "Streaming echo"
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", timeout=60, json={
            "model": MODEL, "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data:")]
    bodies = [json.loads(c) for c in chunks[:-1]]
    whole = post(server, prompt=text, echo=True, logprobs=1, max_tokens=3, ignore_eos=True)["choices"][0]
    assert "".join(b["choices"][0]["text"] for b in bodies) == whole["text"]
    assert bodies[0]["choices"][0]["text"].startswith(text)
    streamed = [v for b in bodies for v in b["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
