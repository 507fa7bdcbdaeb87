"""Two engine replicas on Ray behind the HTTP server (the tiny qwen3 model): the same greedy
outputs as one engine, streaming, the engine's 400, and /metrics per replica."""

from __future__ import annotations

import functools
import json
import re

import pytest
from server_harness import COMPLETIONS, ENGINE_OPTIONS, MODEL, running_server, sse_events

from zipage_jax.llm import LLM
from zipage_jax.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # Ray and two replicas: about a minute

PROMPTS = [[5 + i, 40 + i, 77, 90 + 3 * i, 12] * (2 + i) for i in range(6)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def dp_server(ray_instance, tiny_model_factory, model_cache_dir):
    from zipage_jax.data_parallel.replicated_engine import ReplicatedEngine

    replicated = functools.partial(ReplicatedEngine, data_parallel_size=2)
    with running_server(tiny_model_factory, model_cache_dir, engine_class=replicated) as srv:
        try:
            yield srv
        finally:
            srv.engine.shutdown()


def complete(srv, prompt, **extra) -> dict:
    body = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **extra)
    r = srv.http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def labelled(text: str, name: str) -> dict[str, float]:
    """The samples of metric `name` by their replica label."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(rf'{re.escape(name)}\{{.*replica="(\d+)".*\}} (\S+)', line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def test_greedy_outputs_equal_one_engines_and_both_replicas_serve(dp_server, tiny_model_factory, model_cache_dir,
                                                                  monkeypatch):
    served = [complete(dp_server, prompt)["choices"][0]["text"] for prompt in PROMPTS]
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    llm = LLM(str(tiny_model_factory("qwen3")), **ENGINE_OPTIONS)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    assert served == [e["text"] for e in expected]
    generated = labelled(dp_server.http.get("/metrics").text, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
    assert sum(generated.values()) >= len(PROMPTS) * MAX_TOKENS


def test_a_stream_sends_every_token_and_ends_with_done(dp_server):
    whole = complete(dp_server, PROMPTS[0])["choices"][0]["text"]
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stream=True)
    with dp_server.http.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert len(chunks) == MAX_TOKENS and chunks[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in chunks) == whole


def test_the_engines_refusal_is_a_400_naming_the_problem(dp_server):
    r = dp_server.http.post(COMPLETIONS, json=dict(model=MODEL, prompt=[5, 99999], max_tokens=4))
    assert r.status_code == 400, r.text
    assert "prompt token ids must be integers in [0, " in r.json()["error"]["message"]
    assert dp_server.http.get("/health").status_code == 200


def test_metrics_have_a_sample_per_replica(dp_server):
    text = dp_server.http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        assert set(labelled(text, name)) == {"0", "1"}, name
    assert labelled(text, "zipage:replica_serving") == {"0": 1.0, "1": 1.0}
    blocks = labelled(text, "zipage:kv_total_blocks")
    assert blocks == {"0": ENGINE_OPTIONS["num_kvcache_blocks"] - 1, "1": ENGINE_OPTIONS["num_kvcache_blocks"] - 1}
