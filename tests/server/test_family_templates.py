"""The chat templates of the newer families render through LLM.chat's and the server's chat
rendering on the tiny tokenizer given each family's template and special tokens (templates/:
Gemma 3's, Mixtral's, a minimal harmony one for gpt-oss, written for these tests from the
formats), and a harmony output is split into reasoning, content and tool calls over HTTP.

The expected prompts are written out from the formats, not produced by the code under test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine
from server_harness import CHAT, MODEL, USER, running_server
from tiny_models import build_tokenizer

from zipage_jax.chat import chat_prompt_ids, chat_prompt_text

TEMPLATES = Path(__file__).parent / "templates"
HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# family: (template, its special tokens, BOS, EOS)
FAMILIES = {
    "gemma3": ("gemma3.jinja", ("<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>"),
    "mixtral": ("mixtral.jinja", ("<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>"),
    "gpt-oss": ("gpt-oss.jinja", HARMONY_SPECIALS, "<|start|>", "<|return|>"),
}
CHAT_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}]
HARMONY_SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel must be included "
                  "for every message.<|end|>")
EXPECTED = {
    # the system message folded into the first user turn; the assistant is "model"
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n",
    # the system message opens the first [INST]; no generation prompt of its own
    "mixtral": "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Weather? [/INST]",
    "gpt-oss": HARMONY_SYSTEM.format(effort="medium") + "<|start|>developer<|message|># Instructions\n\nBe brief."
               "<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
               "<|start|>user<|message|>Weather?<|end|><|start|>assistant",
}


def family_tokenizer(family: str):
    template, specials, bos, eos = FAMILIES[family]
    return build_tokenizer(320, (TEMPLATES / template).read_text(), specials, bos, eos)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_renders_with_its_special_tokens_as_single_ids(family):
    tokenizer = family_tokenizer(family)
    expected = EXPECTED[family]
    assert chat_prompt_text(tokenizer, CHAT_TURNS) == expected
    ids = chat_prompt_ids(tokenizer, CHAT_TURNS)
    assert tokenizer.decode(ids) == expected
    for special in FAMILIES[family][1]:
        assert ids.count(tokenizer.convert_tokens_to_ids(special)) == expected.count(special), special
    assert sum(expected.count(special) for special in FAMILIES[family][1]) > 3  # the check above can fail


@pytest.mark.parametrize("family", ["gemma3", "mixtral"])
def test_roles_that_do_not_alternate_are_refused(family):
    with pytest.raises(ValueError, match="the chat template rejected the messages: Conversation roles must alternate"):
        chat_prompt_text(family_tokenizer(family), [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_harmony_renders_tool_calls_tool_results_and_the_reasoning_effort():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'}]
    text = chat_prompt_text(family_tokenizer("gpt-oss"), messages, chat_template_kwargs={"reasoning_effort": "low"})
    assert text == (HARMONY_SYSTEM.format(effort="low") + "<|start|>user<|message|>Weather in Paris?<|end|>"
                    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                    '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                    '<|message|>{"temp_c": 21}<|end|><|start|>assistant')


# -- LLM.chat and the server -----------------------------------------------------------------------------

def model_with_template(tiny_model_factory, tmp_path_factory, arch: str, family: str) -> Path:
    """The tiny `arch` model with the family's tokenizer (its vocab size unchanged)."""
    model_dir = tmp_path_factory.mktemp(f"tiny_{family}_template") / "model"
    shutil.copytree(tiny_model_factory(arch), model_dir)
    family_tokenizer(family).save_pretrained(model_dir)
    return model_dir


@pytest.mark.slow  # compiles the gemma3 and mixtral models' steps
@pytest.mark.parametrize("arch", ["gemma3", "mixtral"])
def test_llm_chat_renders_the_familys_template(tiny_model_factory, tmp_path_factory, model_cache_dir, monkeypatch,
                                               arch):
    from zipage_jax.llm import LLM
    from zipage_jax.sampling_params import SamplingParams

    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    model_dir = model_with_template(tiny_model_factory, tmp_path_factory, arch, arch)
    llm = LLM(str(model_dir), kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=2, max_model_len=256)
    expected_ids = family_tokenizer(arch)(EXPECTED[arch], add_special_tokens=False)["input_ids"]
    assert llm.apply_chat_template(CHAT_TURNS) == expected_ids
    (output,) = llm.chat(CHAT_TURNS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert output["prompt_token_ids"] == expected_ids and len(output["token_ids"]) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_server_chat_completion_renders_the_familys_template(tiny_model_factory, tmp_path_factory, model_cache_dir,
                                                               family):
    model_dir = model_with_template(tiny_model_factory, tmp_path_factory, "qwen3", family)
    expected_ids = family_tokenizer(family)(EXPECTED[family], add_special_tokens=False)["input_ids"]
    with running_server(lambda arch: model_dir, model_cache_dir, engine_class=ScriptedEngine) as srv:
        r = srv.http.post("/tokenize", json={"model": MODEL, "messages": CHAT_TURNS})
        assert r.status_code == 200 and r.json()["tokens"] == expected_ids, r.text
        r = srv.http.post(CHAT, json={"model": MODEL, "messages": CHAT_TURNS, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected_ids)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HARMONY_CALL = ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>"
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                  "Hello there.<|return|>")


@pytest.fixture(scope="module")
def harmony_server(tiny_model_factory, tmp_path_factory, model_cache_dir):
    """A server (scripted tokens) with the harmony tokenizer, the openai_gptoss reasoning parser and
    the openai tool parser."""
    model_dir = model_with_template(tiny_model_factory, tmp_path_factory, "qwen3", "gpt-oss")
    with running_server(lambda arch: model_dir, model_cache_dir, engine_class=ScriptedEngine,
                        enable_auto_tool_choice=True, tool_call_parser="openai",
                        reasoning_parser="openai_gptoss") as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_output_is_split_into_reasoning_content_and_tool_calls_over_http(harmony_server, stream):
    harmony_server.engine.script = HARMONY_ANSWER
    answer = harmony_server.client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                                           stream=stream)
    harmony_server.engine.script = HARMONY_CALL
    call = harmony_server.client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                                         tools=[WEATHER_TOOL], stream=stream)
    if stream:
        answer, call = ([c.choices[0].delta for c in chunks if c.choices] for chunks in (answer, call))
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in answer) == "Easy."
        assert "".join(d.content or "" for d in answer) == "Hello there."
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in call) == "The user wants the weather."
        assert "".join(d.content or "" for d in call) == ""
        calls = [c for d in call for c in d.tool_calls or []]
        assert calls[0].function.name == "get_weather"
        assert "".join(c.function.arguments or "" for c in calls) == '{"city": "Paris"}'
        return
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == ("Easy.", "Hello there.")
    message = call.choices[0].message
    assert message.reasoning_content == "The user wants the weather." and not message.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather",
                                                                                        '{"city": "Paris"}')]
