"""The GGUF tokenizer builder vs transformers' own GGUF tokenizer: same ids, tokens, text, chat."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import build_tokenizer
from tokenizers import normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from zipage_jax.chat import chat_prompt_ids
from zipage_jax.models import gguf as ours_gguf
from zipage_jax.models.gguf_tokenizer import gguf_tokenizer, merges_from_scores
from zipage_jax.models.loading import resolve_source

SP = "\u2581"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, héllo there! It's 2024; we've got 12345 items (3.14%) -- isn't that   odd?",
    "Пример текста. Ελληνικά. العربية نص. हिन्दी पाठ. 日本語のテキスト、中文文本。한국어 텍스트.",
    "Emoji: 😀👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷 ❤️ ✨ 🫠 (newer emoji).",
    "def f(x):\n\tif x  >  0:\r\n        return x ** 2   \n\n\n    # trailing   \t\n}}{{",
    "   leading spaces,\u00a0no-break,\u200bzero-width,\u3000ideographic space, trailing  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "half<|im_end|special <|endoftext|><|endoftext|>glued",
    "",
    " ",
    "\n\n",
]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2+2? Réponds en français 🙂"},
    {"role": "assistant", "content": "4 (quatre)."},
    {"role": "user", "content": "And\tin code?\n```py\nprint(2 + 2)\n```"},
]


def _assert_same(ours, ref, texts) -> None:
    for text in texts:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.tokenize(text) == ref.tokenize(text), text
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        tokens = ref.convert_ids_to_tokens(ids)  # the stop checker's incremental detokenisation
        assert ours.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens), text
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "all_special_ids", "add_bos_token"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref)


@pytest.fixture(scope="module")
def default_pair():
    path = resolve_source("default")
    ours = gguf_tokenizer(ours_gguf.open_gguf(path))
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_default_model_tokenizer_matches_transformers(default_pair):
    ours, ref = default_pair
    assert isinstance(ours, PreTrainedTokenizerFast)
    specials = [t.content for t in ref.added_tokens_decoder.values() if t.special]
    _assert_same(ours, ref, TEXTS + ["".join(specials), " ".join(specials)])
    assert len(specials) == 17 and all(len(ours(t)["input_ids"]) == 1 for t in specials)
    for text in TEXTS:  # byte-level BPE without BOS is lossless
        assert ours.decode(ours(text)["input_ids"]) == text


def test_default_model_every_id_decodes_like_transformers(default_pair):
    ours, ref = default_pair
    every = list(range(len(ref)))
    assert ours.convert_ids_to_tokens(every) == ref.convert_ids_to_tokens(every)
    singles = [[i] for i in every]
    assert ours.batch_decode(singles) == ref.batch_decode(singles)


def test_default_model_chat_template_matches_transformers(default_pair):
    ours, ref = default_pair
    assert ours.chat_template == ref.chat_template and "<|im_start|>" in ours.chat_template
    for conversation in (CONVERSATION, CONVERSATION[1:2]):  # with and without a system message
        text = ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert text == ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        assert chat_prompt_ids(ours, conversation) == chat_prompt_ids(ref, conversation) == ref(text)["input_ids"]


def test_saved_and_reloaded_tokenizer_is_the_same(default_pair, tmp_path):
    """The parameter cache saves the built tokenizer and reloads it as PreTrainedTokenizerFast."""
    ours, ref = default_pair
    ours.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    _assert_same(reloaded, ref, TEXTS)
    assert reloaded.chat_template == ref.chat_template


def _write_gguf(path: Path, kind: str, tokens: list[str], types: list[int], strings: dict[str, str] | None = None,
                **metadata) -> Path:
    """A one-tensor llama GGUF file holding a tokenizer (the parts transformers reads); `strings`
    are raw string keys, `metadata` go through GGUFWriter's add_<name> methods."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _pair(path: Path):
    return gguf_tokenizer(ours_gguf.open_gguf(path)), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# A SentencePiece-style vocabulary as llama.cpp writes it: unknown, control, 256 byte tokens,
# scored pieces (no merges: they are derived from the scores), one user-defined token.
_PIECES = [SP, *"abcdefghijklmnopqrstuvwxyzHWéo中", SP + "t", "th", "he", SP + "th", SP + "the", "in", "er",
           SP + "w", "or", "ld", SP + "wor", SP + "world", SP + "H", "el", "ll", "ell", SP + "He", SP + "Hell",
           SP + "Hello", SP + SP, SP + SP + SP, SP + "é", "ab", "abc", "bc", "a" + "bc" + "d"]


def _spm_gguf(path: Path, **metadata) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_PIECES, "<think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(_PIECES), 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(_PIECES))] + [0.0]
    return _write_gguf(path, "llama", tokens, types, token_scores=scores, bos_token_id=1, eos_token_id=2,
                       unk_token_id=0, **metadata)


SPM_TEXTS = ["Hello world", " Hello  world", "the théorie 中文 <think> x</s>", "\n\tHW  \u00a0!", "<unk> <s> abcd",
             "Emoji 😀 and Ελληνικά", "", "   "]


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    ours, ref = _pair(_spm_gguf(tmp_path / "spm.gguf"))
    _assert_same(ours, ref, SPM_TEXTS + TEXTS)
    assert ours.add_bos_token and ours("Hello")["input_ids"][0] == 1  # llama.cpp's default for SentencePiece
    assert ours.convert_ids_to_tokens(ours("😀")["input_ids"][1:]) == [SP, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ours.decode(ours("the théorie 😀")["input_ids"], skip_special_tokens=True) == "the théorie 😀"


def test_sentencepiece_add_bos_from_the_file(tmp_path):
    ours, ref = _pair(_spm_gguf(tmp_path / "spm.gguf", add_bos_token=False, add_eos_token=True))
    _assert_same(ours, ref, SPM_TEXTS)
    assert ours("Hello")["input_ids"][-1] == 2 and ours("Hello")["input_ids"][0] != 1


def test_merges_from_scores_rank_by_score_then_longer_left():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


# Merges across the places where the split patterns differ: digit runs, a space before a digit,
# upper-case contractions, punctuation before a word, runs of spaces and newlines.
_SPLIT_MERGES = [("Ġ", "t"), ("t", "h"), ("Ġt", "h"), ("Ġ", "1"), ("1", "2"), ("12", "3"), ("Ġ1", "2"),
                 ("'", "M"), ("'", "m"), ("(", "x"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("ĠĠ", "Ġ"), ("Ġ", "("), ("č", "Ċ")]
SPLIT_TEXTS = ["12345 1234567 x2024y (x) ( x", "I'M here, i'm there, YOU'RE;\r\n\r\n   tabs\t\tand 3.14159",
               "the 1 12 123 1234\n\n\nthe"]


def _byte_level_gguf(path: Path, pre: str) -> Path:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in _SPLIT_MERGES]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return _write_gguf(path, "gpt2", tokens, types, tokenizer_pre=pre, bos_token_id=1, eos_token_id=2,
                       add_bos_token=False, token_merges=[" ".join(m) for m in _SPLIT_MERGES])


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm", "default"])
def test_byte_level_split_patterns_match_transformers(pre, tmp_path):
    ours, ref = _pair(_byte_level_gguf(tmp_path / f"{pre}.gguf", pre))
    _assert_same(ours, ref, TEXTS + SPLIT_TEXTS)


def test_split_patterns_differ_on_these_texts(tmp_path):
    """The texts above tell the patterns apart, so the test above checks each pattern."""
    seen = {}
    for pre in ("qwen2", "llama-bpe", "default"):
        ours = gguf_tokenizer(ours_gguf.open_gguf(_byte_level_gguf(tmp_path / f"{pre}.gguf", pre)))
        seen[pre] = [ours(t)["input_ids"] for t in SPLIT_TEXTS]
    assert seen["qwen2"] != seen["llama-bpe"] != seen["default"] != seen["qwen2"]


def test_embedded_tokenizer_json_is_used_as_is(tmp_path):
    """A file carrying Hugging Face's tokenizer.json gets exactly that tokenizer (here one whose
    normalizer lower-cases, which no tokenizer.ggml.* key can express)."""
    tiny = build_tokenizer(320)
    tiny.backend_tokenizer.normalizer = normalizers.Lowercase()
    tokens = [t for t, _ in sorted(tiny.get_vocab().items(), key=lambda kv: kv[1])]
    types = [3 if t in tiny.all_special_tokens else 1 for t in tokens]
    path = _write_gguf(tmp_path / "hf.gguf", "gpt2", tokens, types, eos_token_id=tiny.eos_token_id,
                       strings={"tokenizer.huggingface.json": tiny.backend_tokenizer.to_str()})
    ours = gguf_tokenizer(ours_gguf.open_gguf(path))
    for text in TEXTS + ["THE Heather <|im_end|>"]:
        assert ours(text)["input_ids"] == tiny(text)["input_ids"], text
    assert ours("THE")["input_ids"] == ours("the")["input_ids"] and ours.eos_token == tiny.eos_token


def test_unsupported_tokenizer_kind_and_split_pattern(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer 'bert' .*supported: gpt2, llama"):
        gguf_tokenizer(ours_gguf.open_gguf(path))
    path = _write_gguf(tmp_path / "pre.gguf", "gpt2", ["a", "b"], [1, 1], token_merges=["a b"],
                       tokenizer_pre="falcon")
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'falcon'.*qwen2"):
        gguf_tokenizer(ours_gguf.open_gguf(path))
    path = _spm_gguf(tmp_path / "noscores.gguf")
    reader = ours_gguf.open_gguf(path)
    del reader.fields["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="neither merges nor scores"):
        gguf_tokenizer(reader)
