"""The OpenAI-compatible server, run for real (uvicorn in a thread, a tiny model) and driven
with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import openai
import pytest
import uvicorn
from server_harness import (
    CHAT,
    COMPLETIONS,
    GREEDY,
    MODEL,
    USER,
    ServerThread,
    metrics,
    serve,
    slow_steps,
    wait_for,
    wait_idle,
)

from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient

# -- the openai client -------------------------------------------------------------------------


def test_models_and_health(server):
    assert server.http.get("/health").json() == {"status": "ok"}
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == 256


def test_completion_greedy_matches_stream_and_token_prompt(server):
    tok = server.app.state.engine_client.tokenizer
    prompt = "The fox"
    kwargs = dict(model=MODEL, max_tokens=8, **GREEDY)
    full = server.client.completions.create(prompt=prompt, **kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert full.usage.completion_tokens == 8 and full.usage.total_tokens == full.usage.prompt_tokens + 8
    by_ids = server.client.completions.create(prompt=tok(prompt)["input_ids"], **kwargs)
    assert by_ids.choices[0].text == choice.text
    chunks = list(server.client.completions.create(prompt=prompt, stream=True,
                                                   stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def chat_prompt_ids(server, messages: list[dict]) -> list[int]:
    ids = server.app.state.engine_client.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_renders_the_template(server):
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = dict(model=MODEL, max_tokens=10, **GREEDY)
    chat = server.client.chat.completions.create(messages=messages, **kwargs)
    ids = chat_prompt_ids(server, messages)
    plain = server.client.completions.create(prompt=ids, **kwargs)
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 10
    stream = list(server.client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"


def test_several_prompts_and_n(server):
    prompts = ["one", "two two"]
    solo = [server.client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
            for p in prompts]
    out = server.client.completions.create(model="alias", prompt=prompts, n=2, max_tokens=5, **GREEDY)
    assert out.model == "alias"
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (0, solo[0], "length"), (1, solo[0], "length"), (2, solo[1], "length"), (3, solo[1], "length")]
    tok = server.app.state.engine_client.tokenizer
    as_ids = [tok(p)["input_ids"] for p in prompts]
    assert out.usage.prompt_tokens == len(as_ids[0]) + len(as_ids[1]) and out.usage.completion_tokens == 20
    streamed = list(server.client.completions.create(model=MODEL, prompt=as_ids, n=2, max_tokens=5, stream=True,
                                                     **GREEDY))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(4)]
    assert texts == [solo[0], solo[0], solo[1], solo[1]]
    assert sorted(c.choices[0].index for c in streamed if c.choices[0].finish_reason) == [0, 1, 2, 3]


def test_stop_string(server):
    kwargs = dict(model=MODEL, prompt="Stop here", max_tokens=20, **GREEDY)
    text = server.client.completions.create(**kwargs).choices[0].text
    stop = next(ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd")
    stopped = server.client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]
    assert stopped.model_extra["stop_reason"] == stop


def _ascii(text: str) -> str:
    """Per-token text differs from the whole text only where a token splits a UTF-8 character."""
    return "".join(ch for ch in text if ord(ch) < 128)


def test_logprobs(server):
    messages = [{"role": "user", "content": "x"}]
    out = server.client.completions.create(model=MODEL, prompt=chat_prompt_ids(server, messages), max_tokens=6,
                                           logprobs=2, **GREEDY).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy takes the most likely
    assert _ascii("".join(lp.tokens)) == _ascii(out.text)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, logprobs=True,
                                                 top_logprobs=2, **GREEDY).choices[0]
    content = chat.logprobs.content
    assert chat.message.content == out.text
    assert [c.logprob for c in content] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)
               for c in content)
    assert [c.token for c in content] == lp.tokens and all(c.bytes == list(c.token.encode()) for c in content)


def test_kv_budget_compresses(server):
    before = metrics(server)
    out = server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=64, temperature=0,
                                           extra_body={"ignore_eos": True, "kv_budget": 32,
                                                       "eviction_policy": "streaming"})
    after = metrics(server)
    assert out.usage.completion_tokens == 64
    assert after["zipage:compressions_total"] > before["zipage:compressions_total"]
    deferred = server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=64, temperature=0,
                                                extra_body={"ignore_eos": True, "kv_budget": 32,
                                                            "eviction_policy": "streaming",
                                                            "prompt_compression": "deferred"})
    assert deferred.choices[0].text == out.choices[0].text  # a short prompt: the same compactions
    assert after["zipage:kv_tokens_evicted_total"] > before["zipage:kv_tokens_evicted_total"]


def test_an_automatic_kv_budget_and_its_memory_in_usage(server):
    out = server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=120, temperature=0,
                                           extra_body={"ignore_eos": True, "kv_budget": "auto",
                                                       "kv_budget_max": 64})
    kv = out.usage.model_extra["kv_cache"]
    assert out.usage.completion_tokens == 120
    # 120+ tokens: at its ceiling, beside the prompt (one block) kept whole by default
    assert kv == {"kv_blocks_peak": 80 // 16 + 1, "kv_budget_tokens": 80}
    bounded = server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=120, temperature=0,
                                               extra_body={"ignore_eos": True, "kv_budget": "auto",
                                                           "kv_budget_max": 64, "keep_prompt": False})
    assert bounded.usage.model_extra["kv_cache"] == {"kv_blocks_peak": 64 // 16 + 1, "kv_budget_tokens": 64}
    full = server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=40, n=2, **GREEDY)
    kv_slots = full.usage.prompt_tokens + 40 - 1  # the last token's K/V is never computed
    assert full.usage.model_extra["kv_cache"] == {"kv_blocks_peak": -(-kv_slots // 16), "kv_budget_tokens": 0}
    chunks = list(server.client.completions.create(model=MODEL, prompt="Compress me", max_tokens=8, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"kv_budget": 32}))
    assert chunks[-1].usage.model_extra["kv_cache"]["kv_budget_tokens"] == 32


def test_metrics_names(server):
    server.client.completions.create(model=MODEL, prompt="count me", max_tokens=3, **GREEDY)
    m = metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "zipage:compressions_total", "zipage:kv_tokens_evicted_total", "zipage:seqs_at_budget",
                 "zipage:query_slots_in_use", "zipage:kv_free_blocks"):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 3 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["zipage:kv_free_blocks"] == m["zipage:kv_total_blocks"]  # idle: every block free


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, {"prompt": "x"}, 400, "model"),
    (COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (COMPLETIONS, {"model": MODEL, "prompt": 7}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [True]}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": -1}, 400, "kv_budget"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": 10**6}, 400, "kv_budget"),  # > the pool
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": "most"}, 400, "kv_budget"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": "auto", "kv_budget_max": 0}, 400, "kv_budget_max"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": 64, "kv_budget_max": 128}, 400, "kv_budget_max"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "kv_budget": "auto", "eviction_policy": "streaming"}, 400,
     None),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "eviction_policy": "h2o"}, 400, "eviction_policy"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "prompt_compression": "lazy"}, 400, "prompt_compression"),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),  # 300 tokens > max_model_len 256
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    (CHAT, {"model": "gpt-4", "messages": USER}, 404, "model"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_an_openai_error(server, path, body, status, param):
    if isinstance(body, bytes):
        r = server.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_openai_client_raises_on_bad_input(server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client.completions.create(model=MODEL, prompt="x", top_p=7)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.chat.completions.create(model="nope", messages=USER)


def test_unknown_route_is_an_openai_error(server):
    r = server.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


# -- lifecycle ---------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server):
    start = wait_idle(server, metrics(server)["zipage:kv_total_blocks"])
    body = dict(model=MODEL, prompt="story", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with slow_steps(server), httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert [next(line for line in lines if line.startswith("data:")) for _ in range(3)]
        assert metrics(server)["zipage:kv_free_blocks"] < start["zipage:kv_free_blocks"]
    end = wait_idle(server, start["zipage:kv_free_blocks"])
    assert end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] < 20  # aborted early
    assert end["vllm:e2e_request_latency_seconds_count"] == start["vllm:e2e_request_latency_seconds_count"]


def test_disconnect_while_waiting_for_a_whole_response(server):
    start = wait_idle(server, metrics(server)["zipage:kv_total_blocks"])
    body = dict(model=MODEL, prompt="wait", max_tokens=200, temperature=0, ignore_eos=True)
    with slow_steps(server), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=httpx.Timeout(60, read=0.3))
    end = wait_idle(server, start["zipage:kv_free_blocks"])
    assert end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] < 20
    assert end["vllm:e2e_request_latency_seconds_count"] == start["vllm:e2e_request_latency_seconds_count"]


def test_many_concurrent_streams(server):
    start = wait_idle(server, metrics(server)["zipage:kv_total_blocks"])
    clients, max_tokens = 64, 8
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)

    async def one(i: int) -> tuple[str, int, str]:
        stream = await aclient.completions.create(model=MODEL, prompt=f"c{i}", max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage.completion_tokens, reason

    async def all_clients():
        try:
            return await asyncio.gather(*(one(i) for i in range(clients)))
        finally:
            await aclient.close()

    results = asyncio.run(all_clients())
    assert [(n, reason) for _, n, reason in results] == [(max_tokens, "length")] * clients
    end = wait_idle(server, start["zipage:kv_free_blocks"])
    assert end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] == clients * max_tokens
    solo = server.client.completions.create(model=MODEL, prompt="c5", max_tokens=max_tokens, **GREEDY)
    assert results[5][0] == solo.choices[0].text  # batching did not change greedy output


# -- loading ---------------------------------------------------------------------------------------


def test_health_is_503_while_loading_and_after_a_failed_load():
    release, failures = threading.Event(), []

    def slow_broken_engine():
        release.wait(30)
        raise FileNotFoundError("no such model")

    srv = ServerThread(create_app(InProcessEngineClient(slow_broken_engine), [MODEL],
                                  on_load_error=failures.append))
    try:
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "the model is still loading"
        r = httpx.post(f"{srv.url}{COMPLETIONS}", json=dict(model=MODEL, prompt="x"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        release.set()
        wait_for(lambda: failures, 10, "on_load_error was not called")
        r = httpx.get(f"{srv.url}/health")
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and message == "the model failed to load (the server's log says why)"
    finally:
        srv.close()


def test_n_above_the_servers_max_n_is_refused_even_while_loading():
    release = threading.Event()

    def never_loads():
        release.wait(30)
        raise RuntimeError("not loaded in this test")

    srv = ServerThread(create_app(InProcessEngineClient(never_loads), [MODEL], max_n=2))
    try:
        r = httpx.post(f"{srv.url}{COMPLETIONS}", json=dict(model=MODEL, prompt="x", n=3))
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "n must be <= 2 (this server's --max-n), got 3", "type": "invalid_request_error",
            "param": "n", "code": None}
        assert httpx.post(f"{srv.url}{COMPLETIONS}", json=dict(model=MODEL, prompt="x", n=2)).status_code == 503
    finally:
        release.set()
        srv.close()


def test_serve_binds_localhost_and_exits_when_the_model_cannot_load(tmp_path, caplog, monkeypatch):
    bound = []
    run = uvicorn.Server.run

    def recording_run(self, *args, **kwargs):
        bound.append((self.config.host, self.config.port))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(uvicorn.Server, "run", recording_run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    missing = str(tmp_path / "no-model")
    assert serve("--model", missing, "--port", str(port), "--kvcache-block-size", "16") == 1
    assert bound == [("127.0.0.1", port)]
    assert "no-model' does not exist" in caplog.text


def test_serve_rejects_bad_engine_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve("--kvcache-block-size", "24")
    assert exit_info.value.code == 2 and "kvcache_block_size" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [("--max-n", "0", "max_n must be in [1, 128], got 0"),
                                                  ("--max-n", "129", "max_n must be in [1, 128], got 129"),
                                                  ("--max-request-bytes", "0", "max_request_bytes must be >= 1"),
                                                  ("--max-stop-strings", "0", "--max-stop-strings must be >= 1"),
                                                  ("--max-chat-messages", "0", "--max-chat-messages must be >= 1"),
                                                  ("--max-chat-bytes", "0", "--max-chat-bytes must be >= 1"),
                                                  ("--max-queued-requests", "0", "max_queued_requests must be >= 1"),
                                                  ("--api-key", "", "api_key must be a non-empty string"),
                                                  ("--api-key", "a b", "api_key must be a non-empty string")])
def test_serve_rejects_bad_server_flags(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        serve(flag, value)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
