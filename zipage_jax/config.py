"""Engine options, with vLLM / Zipage names, validated once at construction and never changed.

The scoring options are a `CompressionConfig` (zipage_jax/compress/config.py) held as the field
`compression`; `from_options` (what LLM(...), the CLI and the server use) takes them flat, by
their own names, beside the engine's. Every field is documented in the field itself (`option`,
which the server's config uses too), which is the help of its command-line flag.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from pallas_kernels.kv_quant import KV_CACHE_DTYPES
from zipage_jax.compress.config import CompressionConfig, option
from zipage_jax.compress.policies import DEFAULT_POLICY, get_policy

PROMPT_COMPRESSION = ("bounded", "deferred")


@dataclass(frozen=True)
class EngineConfig:
    model: str = option("default", doc="a packaged model name (zipage_jax/models/packaged.py; \"default\" is "
                                       "SmolLM2-135M-Instruct), a transformers model directory, a GGUF file or a "
                                       "Hugging Face model id (org/name: its config, tokenizer and safetensors "
                                       "weights are downloaded once)")
    revision: str | None = option(None, doc="the Hugging Face model's revision: a branch, tag or commit hash; "
                                            "default: main")
    download_dir: str | None = option(None, doc="where Hugging Face models are downloaded to and looked up; default: "
                                                "huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub, else "
                                                "~/.cache/huggingface/hub)")
    dtype: str | None = option(None, doc="the model's dtype: float32, bfloat16 or float16; default: float32 on CPU, "
                                         "bfloat16 on GPU")
    max_num_seqs: int = option(64, doc="sequences running at once")
    max_num_batched_tokens: int = option(2048, doc="tokens in one step (a prefill chunk is at most this long)")
    max_model_len: int | None = option(None, doc="tokens a sequence may reach (prompt and output); default: the "
                                                 "model's max_position_embeddings")
    kvcache_block_size: int = option(256, doc="tokens per KV cache block (a power of two >= 16)")
    num_kvcache_blocks: int | None = option(None, doc="blocks in the KV pool; default: as many as kvcache_memory_gb "
                                                      "holds")
    kvcache_memory_gb: float = option(2.0, doc="device memory for the KV pool, in GB (unless num_kvcache_blocks)")
    enable_prefix_caching: bool = option(True, doc="share the KV blocks of a prompt prefix seen before")
    attention_backend: Literal["auto", "xla", "pallas"] = option(
        "auto", doc="attention kernels: pallas (GPU), xla, or auto (pallas on GPU, else xla)")
    seed: int = option(0, doc="seed of the random numbers of requests that give none")
    compilation_cache_dir: str | None = option(
        None, doc="where compiled programs are stored; default: $ZIPAGE_JAX_CACHE/executables/<host CPU>; "
                  "\"\": off")
    log_interval_s: float = option(10.0, doc="seconds between the engine's log lines of its statistics")
    max_cache_blocks_per_seq: int | None = option(
        None, doc="KV budget of a sequence, in blocks: a longer sequence is compressed to it; default: full KV "
                  "(SamplingParams.kv_budget overrides it)")
    auto_budget: bool = option(False, doc="requests without a kv_budget of their own get kv_budget=\"auto\": "
                                          "each compaction keeps the fewest blocks that lose at most "
                                          "auto_budget_threshold of the attention, else the budget grows "
                                          "(instead of max_cache_blocks_per_seq)")
    auto_budget_threshold: float = option(0.01, doc="kv_budget=\"auto\": the largest share of the cached queries' "
                                                    "attention a compaction may evict")
    auto_budget_min: int = option(32, doc="kv_budget=\"auto\": the fewest KV tokens a sequence keeps, and the "
                                          "tokens its budget grows by (rounded up to blocks)")
    auto_budget_keeps_prompt: bool = option(True, doc="kv_budget=\"auto\": keep the prompt whole beside the "
                                                      "automatic budget, so that it sizes only what the request "
                                                      "generates (memory: the prompt plus at most auto_budget_max); "
                                                      "a request's keep_prompt overrides it")
    auto_budget_max: int = option(2048, doc="kv_budget=\"auto\": the most KV tokens a sequence keeps (rounded "
                                            "down to blocks); SamplingParams.kv_budget_max overrides it")
    query_cache_len: int = option(16, doc="the last queries of a sequence kept to score its tokens (at most "
                                          "kvcache_block_size)")
    prompt_compression: Literal["bounded", "deferred"] = option(
        "bounded", doc="a prompt longer than its budget: bounded compacts between chunks (peak: budget + one "
                       "chunk), deferred once at the prompt's end (peak: the whole prompt); "
                       "SamplingParams.prompt_compression overrides it")
    prompt_window: int = option(32, doc="the prompt's last tokens whose queries score each compaction inside the "
                                        "prompt (at most half a step, and none when a step has a single prefill "
                                        "row); 0: each chunk's own queries")
    compression: CompressionConfig = option(default_factory=CompressionConfig, doc="the scoring options")
    eviction_policy: str = option(DEFAULT_POLICY, doc="which tokens a full sequence keeps (compress/policies.py); "
                                                      "SamplingParams.eviction_policy overrides it")
    sink_len: int | None = option(None, doc="protected first tokens; default: each policy's own (zipage 0, "
                                            "others 4)")
    recent_fraction: float | None = option(None, doc="window policies: share of the budget kept as the most "
                                                     "recent tokens; default: each policy's own")
    prompt_fraction: float | None = option(None, doc="prompt-reserve policies: share of the budget reserved for "
                                                     "the prompt; default: each policy's own")
    kv_cache_dtype: str = option("auto", doc="auto (the model dtype), int8 or fp8 (e4m3): per-token scales; int4: "
                                             "packed, a float16 scale per 32 elements (head_dim a multiple of 64)")
    profile_compaction: bool = option(False, doc="time each compaction alone (it then blocks on the device)")
    enable_hybrid_engine: bool = option(True, doc="give a sequence a query slot only once its queries will be "
                                                  "scored (off: every sequence may hold one)")
    max_compress_seqs: int = option(8, doc="sequences compacted in one step")
    tensor_parallel_size: int = option(1, doc="devices the model's heads are sharded over")
    enable_expert_parallel: bool = option(False, doc="split a mixture of experts over the tensor_parallel_size "
                                                     "devices by expert (each holds num_experts / "
                                                     "tensor_parallel_size whole experts; router and attention as "
                                                     "under tensor parallelism) instead of splitting every "
                                                     "expert's width; no effect on a dense model or one device")
    async_scheduling: bool = option(True, doc="schedule and dispatch step N+1 before step N's tokens reach the host")
    prefill_row_size: int = option(32, doc="tokens per row of a prefill batch (a chunk spans several rows; a power "
                                           "of two)")
    warmup: bool = option(False, doc="compile every step shape the configuration can reach at start-up")

    def __post_init__(self) -> None:
        bs = self.kvcache_block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {bs}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 2:
            raise ValueError(f"num_kvcache_blocks must be >= 2, got {self.num_kvcache_blocks}")
        if self.kvcache_memory_gb <= 0:
            raise ValueError(f"kvcache_memory_gb must be > 0, got {self.kvcache_memory_gb}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend must be auto, xla or pallas, got {self.attention_backend!r}")
        if self.max_cache_blocks_per_seq is not None:
            _positive("max_cache_blocks_per_seq", self.max_cache_blocks_per_seq)
        if self.auto_budget and self.max_cache_blocks_per_seq is not None:
            raise ValueError("auto_budget and max_cache_blocks_per_seq are two default budgets: set one")
        if not 0.0 <= self.auto_budget_threshold < 1.0:
            raise ValueError(f"auto_budget_threshold must be in [0, 1), got {self.auto_budget_threshold}")
        _positive("auto_budget_min", self.auto_budget_min)
        _positive("auto_budget_max", self.auto_budget_max)
        if not 1 <= self.query_cache_len <= bs:
            raise ValueError(f"query_cache_len must be in [1, kvcache_block_size={bs}], got {self.query_cache_len}")
        if self.prompt_compression not in PROMPT_COMPRESSION:
            raise ValueError(f"prompt_compression must be one of {', '.join(PROMPT_COMPRESSION)}, "
                             f"got {self.prompt_compression!r}")
        if not isinstance(self.prompt_window, int) or isinstance(self.prompt_window, bool) or self.prompt_window < 0:
            raise ValueError(f"prompt_window must be an integer >= 0, got {self.prompt_window!r}")
        if not isinstance(self.compression, CompressionConfig):
            raise ValueError(f"compression must be a CompressionConfig, got {type(self.compression).__name__}")
        get_policy(self.eviction_policy)
        if self.sink_len is not None and (not isinstance(self.sink_len, int) or self.sink_len < 0):
            raise ValueError(f"sink_len must be an integer >= 0, got {self.sink_len!r}")
        if self.recent_fraction is not None and not 0.0 <= self.recent_fraction < 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1), got {self.recent_fraction}")
        if self.prompt_fraction is not None and not 0.0 <= self.prompt_fraction < 1.0:
            raise ValueError(f"prompt_fraction must be in [0, 1), got {self.prompt_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        rows = self.prefill_row_size
        if not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
            raise ValueError(f"prefill_row_size must be a power of two >= 1, got {rows!r}")
        _positive("max_compress_seqs", self.max_compress_seqs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """The config from flat options: the engine's fields and CompressionConfig's, by name."""
        scoring_names = {f.name for f in dataclasses.fields(CompressionConfig)}
        unknown = sorted(set(options) - {f.name for f, _ in option_fields()} - {"compression"})
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        scoring = {k: options.pop(k) for k in list(options) if k in scoring_names}
        if scoring:
            if "compression" in options:
                raise ValueError("give the scoring options either flat or as compression=, not both")
            options["compression"] = CompressionConfig(**scoring)
        return cls(**options)

    @property
    def row_size(self) -> int:
        """Tokens per prefill row: prefill_row_size, or less when a step holds fewer tokens."""
        return min(self.prefill_row_size, 1 << (self.max_num_batched_tokens.bit_length() - 1))


def option_fields() -> list[tuple[dataclasses.Field, object]]:
    """(field, type) of every flat option `from_options` takes: the engine's, then the scoring ones."""
    engine = typing.get_type_hints(EngineConfig)
    scoring = typing.get_type_hints(CompressionConfig)
    return ([(f, engine[f.name]) for f in dataclasses.fields(EngineConfig) if f.name != "compression"]
            + [(f, scoring[f.name]) for f in dataclasses.fields(CompressionConfig)])


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
