"""Random-initialised models with a byte tokenizer: a model's speed at a real shape without its
weights or a download (`bench gpu`'s Qwen3-8B, `bench long`'s attention-bound model, `bench
host`'s tiny model). The names in RANDOM_MODELS load like any model (`load_model`, `--model`):
their tokens mean nothing, so they serve benchmarks and plumbing tests only."""

from __future__ import annotations

import time

# Qwen3-8B's shape as ModelConfig fields (the Hugging Face config's values; no EOS: a random model's
# tokens mean nothing)
QWEN3_8B = dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, rope_scaling=None, max_position_embeddings=40960,
                tie_word_embeddings=False, qkv_bias=False, o_bias=False, qk_norm=True,
                bos_token_id=None, eos_token_ids=())
TINY_QWEN3 = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


class ByteTokenizer:
    """Bytes as token ids: all a random model needs to take prompts and return text."""

    eos_token_id = None

    def __call__(self, text: str, **_options) -> dict:
        return {"input_ids": list(text.encode())}

    def __len__(self) -> int:  # the engine accepts token ids below min(model vocabulary, tokenizer's)
        return 256

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> list[str]:
        return [f"<{i}>" for i in ids]

    def convert_tokens_to_string(self, tokens) -> str:
        return "".join(tokens)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids))


# random-initialised models by name (ModelConfig fields): Qwen3's architecture (GQA, q/k norms)
# at sizes where attention over a long context dominates a CPU step, and a tiny one whose device
# time is negligible (the host's share of a step shows)
RANDOM_MODELS = {
    "random-qwen3": {**QWEN3_8B, "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1024,
                     "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "random-qwen3-tiny": {**TINY_QWEN3, "vocab_size": 256},
}


def random_model(shape: dict, dtype: str, num_layers: int | None = None):
    """A LoadedModel with normal(0.02) random weights of the given ModelConfig fields."""
    import jax.numpy as jnp
    from flax import nnx

    from zipage_jax.models.config import ModelConfig
    from zipage_jax.models.decoder import Decoder
    from zipage_jax.models.loading import LoadedModel

    start = time.perf_counter()
    cfg = ModelConfig(**{**shape, **({"num_layers": num_layers} if num_layers else {})})
    model = Decoder(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    return LoadedModel(config=cfg, model=model, tokenizer=ByteTokenizer(),
                       source=f"random {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}",
                       from_cache=False, load_seconds=time.perf_counter() - start)
