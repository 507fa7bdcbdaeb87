"""What third-party OpenAI and vLLM clients send beyond the basics: models.retrieve, vLLM's
/tokenize, /detokenize and /version, continuous usage in streams, cached prompt tokens in
usage, and request counts bounded only by the server's flags (unbounded by default)."""

from __future__ import annotations

import json
import threading
import tomllib

import httpx
import openai
import pytest
from server_harness import CHAT, COMPLETIONS, GREEDY, MODEL, ROOT, USER, ServerThread, slow_steps, sse_events
from transformers import AutoTokenizer

from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient
from zipage_jax.server.limits import RequestLimits

VOCAB = 320  # the tiny model's
BLOCK = 16  # ENGINE_OPTIONS' kvcache_block_size


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """The tiny model's tokenizer, loaded independently of the server."""
    return AutoTokenizer.from_pretrained(tiny_model_factory("qwen3"))


# -- /v1/models/{model} --------------------------------------------------------------------------


def test_models_retrieve(server):
    for name in (MODEL, "alias"):
        card = server.client.models.retrieve(name)
        assert (card.id, card.object, card.owned_by, card.model_extra["max_model_len"]) == (
            name, "model", "zipage-jax", 256)
        assert card.model_dump() == next(m.model_dump() for m in server.client.models.list().data if m.id == name)
    with pytest.raises(openai.NotFoundError) as info:
        server.client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


@pytest.fixture
def never_loading():
    """Builds a server whose model never loads: the checks made before the engine answer."""
    release, servers = threading.Event(), []

    def build(names: list[str], **options) -> ServerThread:
        def never_loads():
            release.wait(30)
            raise RuntimeError("not loaded in this test")

        servers.append(ServerThread(create_app(InProcessEngineClient(never_loads), names, **options)))
        return servers[-1]

    yield build
    release.set()
    for srv in servers:
        srv.close()


def test_a_model_name_with_a_slash_is_retrieved(never_loading):
    srv = never_loading(["org/model"])
    r = httpx.get(f"{srv.url}/v1/models/org/model")
    assert r.status_code == 200 and r.json()["id"] == "org/model" and r.json()["max_model_len"] is None
    assert httpx.get(f"{srv.url}/v1/models/org").status_code == 404


# -- /tokenize, /detokenize, /version ----------------------------------------------------------------


def test_tokenize_a_prompt(server, reference):
    text = "The quick brown fox"
    expected = reference(text)["input_ids"]
    r = server.http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    r = server.http.post("/tokenize", json={"prompt": text, "return_token_strs": True, "add_special_tokens": False})
    assert r.json()["tokens"] == expected
    assert r.json()["token_strs"] == reference.convert_ids_to_tokens(expected)
    completion = server.client.completions.create(model=MODEL, prompt=text, max_tokens=1, **GREEDY)
    assert completion.usage.prompt_tokens == len(expected)


def test_tokenize_chat_messages(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
        r = server.http.post("/tokenize", json={"model": "alias", "messages": messages,
                                                "add_generation_prompt": add_generation_prompt})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == list(expected) and r.json()["count"] == len(expected)
    with_prompt = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert with_prompt > len(expected)  # the generation prompt adds tokens
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **GREEDY)
    assert chat.usage.prompt_tokens == with_prompt


def test_detokenize(server, reference):
    ids = reference("Hello wörld")["input_ids"] + [reference.eos_token_id]
    r = server.http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": reference.decode(ids)}
    assert r.json()["prompt"].startswith("Hello wörld")
    assert server.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_version_is_the_package_version(server):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert server.http.get("/version").json() == {"version": pyproject["project"]["version"]}


BAD_TOKENIZER_INPUT = [  # (path, body, status, param)
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", [1, 2], 400, None),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_TOKENIZER_INPUT,
                         ids=[str(i) for i in range(len(BAD_TOKENIZER_INPUT))])
def test_bad_tokenizer_input_is_an_openai_error(server, path, body, status, param):
    r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error
    assert error["code"] == ("model_not_found" if status == 404 else None)


# -- streams and usage -----------------------------------------------------------------------------


def _stream(server, path: str, body: dict) -> list[dict]:
    with server.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
# The streams below are paced (slow_steps) so that the server keeps up with the engine: a chunk per
# token. A handler that lags gets its outputs merged, several tokens a chunk (server/output_sink.py).


def test_continuous_usage_stats_on_completions(server, reference):
    prompts = ["one two", "three"]
    body = dict(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0, ignore_eos=True, stream=True)
    with slow_steps(server):
        chunks = _stream(server, COMPLETIONS, {**body, "stream_options": CONTINUOUS})
    *choice_chunks, last = chunks
    seen = {i: 0 for i in range(4)}
    for chunk in choice_chunks:
        [choice] = chunk["choices"]
        seen[choice["index"]] += 1
        prompt_tokens = len(reference(prompts[choice["index"] // 2])["input_ids"])
        assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": seen[choice["index"]],
                                  "total_tokens": prompt_tokens + seen[choice["index"]]}
    assert seen == {i: 4 for i in range(4)}
    prompt_tokens = sum(len(reference(p)["input_ids"]) for p in prompts)
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == prompt_tokens
    assert last["usage"]["completion_tokens"] == 16 and "cached_tokens" in last["usage"]["prompt_tokens_details"]
    with slow_steps(server):
        plain = _stream(server, COMPLETIONS, {**body, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": False}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] == last["usage"]
    assert [c["choices"] for c in plain[:-1]] == [c["choices"] for c in choice_chunks]


def test_continuous_usage_stats_on_chat_with_the_openai_client(server):
    with slow_steps(server):
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, stream=True,
                                                            stream_options=CONTINUOUS, **GREEDY))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    assert [c.usage.completion_tokens for c in chunks[1:-1]] == [1, 2, 3, 4, 5]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_cached_prompt_tokens_from_the_prefix_cache(server):
    prompt = "cache me if you can " * 8  # ~100 tokens: several full blocks
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    first = server.client.completions.create(**kwargs).usage
    second = server.client.completions.create(**kwargs).usage
    assert first.prompt_tokens == second.prompt_tokens > 4 * BLOCK
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.prompt_tokens and cached % BLOCK == 0
    streamed = list(server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached

    messages = [{"role": "user", "content": "remember this " * 10}]
    chat = [server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY).usage
            for _ in range(2)]
    assert chat[0].prompt_tokens_details.cached_tokens == 0
    assert chat[1].prompt_tokens_details.cached_tokens > 0 and chat[1].prompt_tokens_details.cached_tokens % BLOCK == 0


# -- request bounds: unbounded by default, a flag's bound refused naming it -------------------------------


def test_hundreds_of_prompts_in_one_request_are_queued(server):
    prompts = [f"prompt {i}" for i in range(300)]  # the engine runs 8 sequences at once
    out = server.client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, **GREEDY)
    assert [c.index for c in out.choices] == list(range(300))
    assert all(c.finish_reason == "length" for c in out.choices) and out.usage.completion_tokens == 600
    solo = server.client.completions.create(model=MODEL, prompt=prompts[123], max_tokens=2, **GREEDY)
    assert out.choices[123].text == solo.choices[0].text


def test_many_long_stop_strings_and_messages_are_served_by_default(server):
    stops = [f"{i:03d}" + "z" * 400 for i in range(40)]  # over the bounds a server may set
    r = server.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stop": stops})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(21)]
    r = server.http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


LIMITS = RequestLimits(max_prompts=2, max_stop_strings=2, max_stop_chars=3, max_chat_messages=1)
OVER_THE_FLAGS = [  # (path, body, param, message)
    (COMPLETIONS, {"prompt": ["a", "b", "c"]}, "prompt",
     "prompt holds 3 prompts, more than this server's --max-prompts-per-request of 2"),
    (COMPLETIONS, {"prompt": [[1], [2], [3]]}, "prompt", "--max-prompts-per-request of 2"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c"]}, "stop",
     "stop holds 3 strings, more than this server's --max-stop-strings of 2"),
    (COMPLETIONS, {"prompt": "x", "stop": "abcd"}, "stop",
     "stop holds a string of 4 characters, more than this server's --max-stop-chars of 3"),
    (CHAT, {"messages": USER * 2}, "messages", "messages: 2 messages, more than this server's "
                                               "--max-chat-messages of 1"),
    (CHAT, {"messages": USER, "stop": ["a", "b", "c"]}, "stop", "--max-stop-strings of 2"),
    ("/tokenize", {"messages": USER * 2}, "messages", "--max-chat-messages of 1"),
]
WITHIN_THE_FLAGS = [
    (COMPLETIONS, {"prompt": ["a", "b"], "stop": ["abc", "d"]}),
    (COMPLETIONS, {"prompt": list(range(10))}),  # one prompt of token ids
    (CHAT, {"messages": USER, "stop": "abc"}),
    ("/tokenize", {"messages": USER}),
]


def test_a_flags_bound_is_a_400_naming_the_param_and_the_flag(never_loading):
    srv = never_loading([MODEL], limits=LIMITS)
    for path, body, param, message in OVER_THE_FLAGS:
        r = httpx.post(f"{srv.url}{path}", json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], r.json()
    for path, body in WITHIN_THE_FLAGS:  # admitted: they reach the engine, which is still loading
        r = httpx.post(f"{srv.url}{path}", json={"model": MODEL, **body})
        assert r.status_code == 503, (body, r.text)


def _limit_nodes(schema) -> list[dict]:
    if isinstance(schema, dict):
        return ([schema] if "x-limit-flag" in schema else []) + [n for v in schema.values() for n in _limit_nodes(v)]
    if isinstance(schema, list):
        return [n for v in schema for n in _limit_nodes(v)]
    return []


def test_the_openapi_document_states_the_flags_bounds(never_loading):
    bounded = _limit_nodes(httpx.get(f"{never_loading([MODEL], limits=LIMITS).url}/openapi.json").json())
    default = _limit_nodes(httpx.get(f"{never_loading([MODEL]).url}/openapi.json").json())
    expected = {"--max-prompts-per-request": ("maxItems", 2), "--max-stop-strings": ("maxItems", 2),
                "--max-stop-chars": ("maxLength", 3), "--max-chat-messages": ("maxItems", 1)}
    assert {n["x-limit-flag"] for n in bounded} == set(expected)
    for node in bounded:
        key, bound = expected[node["x-limit-flag"]]
        assert node[key] == bound, node
    bounds = {n["x-limit-flag"]: (n.get("maxItems"), n.get("maxLength")) for n in default}
    assert bounds == {"--max-prompts-per-request": (None, None), "--max-stop-strings": (None, None),
                      "--max-stop-chars": (None, None), "--max-chat-messages": (10_000, None)}  # by default


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="--max-stop-chars must be >= 1"):
        RequestLimits(max_stop_chars=0)
