"""Tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral / Gemma 3 / gpt-oss checkpoints in transformers'
format, built offline.

The tokenizer is byte-level BPE over the 256 byte tokens plus ChatML specials and a fixed
list of merges (" a".." z", common English pairs) filling the model's vocab_size, so every id decodes.
"""

from __future__ import annotations

from pathlib import Path

ARCHS = ("qwen3", "qwen2", "llama")
MOE_ARCHS = ("qwen3_moe", "mixtral")  # mixtures of experts (not in ARCHS: the dense families' fixtures)
GEMMA_ARCHS = ("gemma3",)  # sliding-window attention (not in ARCHS either)
GPT_OSS_ARCHS = ("gpt_oss",)  # sinks, biased experts, YaRN, alternating sliding layers (not in ARCHS either)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_ARCH_CONFIGS = {
    # head_dim 32 != hidden / heads; tied embeddings; q/k norm
    "qwen3": dict(head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0),
    # q/k/v biases; untied
    "qwen2": dict(tie_word_embeddings=False, rope_theta=10_000.0),
    # llama3 RoPE scaling with a short original context so most frequencies are rescaled
    "llama": dict(
        tie_word_embeddings=False,
        rope_theta=500_000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # 8 experts of width 32, top 2, weights not renormalised; q/k norm; untied
    "qwen3_moe": dict(head_dim=32, tie_word_embeddings=False, rope_theta=1_000_000.0, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    # 4 experts of width 48 (intermediate_size), top 2, always renormalised; tied
    "mixtral": dict(tie_word_embeddings=True, rope_theta=1_000_000.0, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48),
    # Gemma 3 text: windows of 8 tokens in layers 0, 1 (full: 2), 5 layers (the pattern does not divide
    # them); a softmax scale of 24**-0.5, not head_dim's; linear RoPE scaling on the full layers only;
    # final logits soft-capped at 4
    "gemma3": dict(head_dim=32, num_hidden_layers=5, sliding_window=8, sliding_window_pattern=3,
                   query_pre_attn_scalar=24, final_logit_softcapping=4.0, tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="linear", factor=4.0)),
    # gpt-oss: 4 experts of width 32, top 2, a SwiGLU clamped at 1 (the tiny weights reach it); windows
    # of 8 in layers 0 and 2; YaRN over an original context of 16 tokens, so most frequencies are
    # interpolated and cos/sin scaled; q/k/v/o and expert biases; sinks (set in save_tiny_model)
    "gpt_oss": dict(head_dim=32, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=32, sliding_window=8, swiglu_limit=1.0, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=16)),
}


_MERGES = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"] + [
    tuple(p)
    for p in "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve co me"
    " de hi ri ro ic ne ea ra ce li ch ll be ma si om ur".split()
]


def build_tokenizer(vocab_size: int, chat_template: str = CHAT_TEMPLATE, extra_special_tokens: tuple[str, ...] = (),
                    bos_token: str = "<|im_start|>", eos_token: str = "<|im_end|>"):
    """The tiny tokenizer; another family's `chat_template` comes with the special tokens it writes
    (`extra_special_tokens`, ids 3.. after the ChatML ones, fewer merges filling the vocab) and its
    BOS and EOS (among the special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS) + list(extra_special_tokens)
    if bos_token not in specials or eos_token not in specials:
        raise ValueError(f"the BOS and EOS tokens ({bos_token}, {eos_token}) must be among the special tokens")
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = _MERGES[: vocab_size - len(tokens)]
    if len(tokens) + len(merges) != vocab_size:
        raise ValueError(f"tiny tokenizer vocab_size must be in [{len(tokens)}, {len(tokens) + len(_MERGES)}]")
    tokens += [a + b for a, b in merges]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def hf_config(arch: str, **overrides):
    import transformers

    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS + MOE_ARCHS + GEMMA_ARCHS + GPT_OSS_ARCHS}")
    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "gemma3": transformers.Gemma3TextConfig, "gpt_oss": transformers.GptOssConfig}
    return cls[arch](**{**_COMMON, **_ARCH_CONFIGS[arch], **overrides})


def save_tiny_model(arch: str, path: str | Path, *, sharded: bool = False, seed: int = 0, **overrides) -> Path:
    """Save a random float32 `arch` model (config, safetensors, tokenizer) into `path`."""
    import torch
    import transformers

    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so loading them is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # logits of the order of the attention scores'
                p.copy_(torch.randn_like(p))
    path = Path(path)
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "1GB")
    build_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows (undone by the loaders)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    """The inverse of zipage_jax.models.gguf.hf_name."""
    from zipage_jax.models import gguf as ours

    for g, hf in ours._GLOBAL_NAMES.items():
        if hf == hf_name:
            return g
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, leaf = rest.rsplit(".", 1)
    g = next(g for g, hf in ours._LAYER_NAMES.items() if hf == module)
    return f"blk.{layer}.{g}.{leaf}"


def _gguf_tensors(tensors: dict, model_type: str, per_expert: bool) -> dict:
    """A saved model's tensors by llama.cpp's names: Mixtral's named as Qwen3-MoE's, each layer's
    experts stacked as llama.cpp writes them ([E, out, in], blk.N.ffn_gate_exps.weight) or, with
    `per_expert`, one tensor per expert (blk.N.ffn_gate.J.weight, older Mixtral files)."""
    import re

    import numpy as np

    from zipage_jax.models.weights import _MIXTRAL_NAMES

    out, stacks = {}, {}
    for name, value in sorted(tensors.items()):
        if model_type == "mixtral":
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[_gguf_name(name)] = value
        elif per_expert:
            out[f"blk.{m[1]}.ffn_{m[3]}.{m[2]}.weight"] = value
        else:
            stacks.setdefault(f"blk.{m[1]}.ffn_{m[3]}_exps.weight", {})[int(m[2])] = value
    for name, experts in stacks.items():
        out[name] = np.stack([experts[j] for j in range(len(experts))])
    return out


def save_tiny_gguf(model_dir: str | Path, path: str | Path, *, qtype: str = "F32", per_expert: bool = False) -> Path:
    """Write a tiny saved model (no RoPE scaling) as a llama.cpp-style GGUF file.

    Matrices (experts' included) are stored as `qtype` (F32, F16, or a type gguf-py quantizes in
    32-blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; the hidden sizes are multiples of 32, not 256), norms,
    biases and routers as F32; the tokenizer goes in as gpt2-style BPE. Qwen3-MoE is written as
    "qwen3moe" (only with norm_topk_prob: llama.cpp always renormalises), Mixtral as "llama" with
    experts, stacked or `per_expert`.
    """
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir, path = Path(model_dir), Path(path)
    c = json.loads((model_dir / "config.json").read_text())
    arch = c["model_type"]
    if (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ValueError("GGUF files cannot carry this RoPE scaling; save the model with rope_scaling=None")
    if arch == "qwen3_moe" and not c["norm_topk_prob"]:
        raise ValueError("llama.cpp always renormalises Qwen3-MoE's top-k weights; save it with norm_topk_prob=True")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    gguf_arch = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(arch, arch)
    w = gguf.GGUFWriter(path, gguf_arch)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    if arch in ("qwen3_moe", "mixtral"):
        w.add_expert_count(c.get("num_experts") or c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
    if arch == "qwen3_moe":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_pad_token_id(c["pad_token_id"])
    w.add_add_bos_token(False)

    files = sorted(model_dir.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    for gname, value in _gguf_tensors(tensors, arch, per_expert).items():
        if gguf_arch == "llama" and ".attn_q." in gname:
            value = _llama_cpp_permute(value, c["num_attention_heads"])
        elif gguf_arch == "llama" and ".attn_k." in gname:
            value = _llama_cpp_permute(value, c["num_key_value_heads"])
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim >= 2 and qtype != "F32" and ".ffn_gate_inp." not in gname:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(value, q), raw_dtype=q)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
