"""A benchmark's requests and KV pool: the workload (how many requests, prompt lengths, tokens
generated, budget, pool), the pools of one size in bytes for every KV dtype, prompts cut from
real text and the engine config of one run. Shared by `bench throughput`, `bench long` and
`bench gpu`."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np

RECOMMENDED_SCORING = dict(eviction_policy="zipage", use_global_score=True, enable_pooling=True, redundancy="lightning")


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_len_min: int
    prompt_len_max: int
    max_tokens: int
    block_size: int
    budget_blocks: int  # M: blocks kept per compressed sequence
    pool_blocks: int | None = None  # None: (M + 1) per request, plus the dummy block (or pool_gb)
    pool_gb: float | None = None  # the pool in GiB instead (bytes / bytes per block, plus the dummy block)
    seed: int = 0

    @property
    def num_pool_blocks(self) -> int:
        """The pool in blocks of the default KV dtype (when not given in bytes)."""
        return self.pool_blocks or self.requests * (self.budget_blocks + 1) + 1

    def check(self) -> None:
        if self.requests < 1 or self.max_tokens < 1:
            raise ValueError("requests and max_tokens must be >= 1")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"need 1 <= prompt_len_min <= prompt_len_max, "
                             f"got {self.prompt_len_min}, {self.prompt_len_max}")
        if self.pool_blocks is not None and self.pool_gb is not None:
            raise ValueError("give the pool in blocks or in GiB, not both")
        if self.pool_gb is None:
            self.check_fits(self.num_pool_blocks)

    def check_fits(self, pool_blocks: int) -> None:
        """ValueError unless full KV can hold the longest request in a pool of `pool_blocks`."""
        pool_tokens = (pool_blocks - 1) * self.block_size
        longest = self.prompt_len_max + self.max_tokens
        if longest > pool_tokens:
            raise ValueError(f"the longest request ({longest} tokens) does not fit the pool of {pool_tokens} "
                             "tokens with full KV: raise --num-kvcache-blocks or lower --max-tokens")


@dataclass(frozen=True)
class Pool:
    """One engine's KV pool: `blocks` blocks (the dummy block 0 included) of `block_bytes` each."""

    kv_cache_dtype: str  # the engine option: "auto", "int8", "fp8" or "int4"
    kv_dtype: str  # what the pool stores (int4: uint8, two values a byte)
    block_bytes: int  # K and V of every layer (and a quantized pool's scales)
    blocks: int
    block_size: int

    @property
    def bytes(self) -> int:
        """Usable bytes (the dummy block left out, as kvcache_memory_gb counts them)."""
        return (self.blocks - 1) * self.block_bytes

    @property
    def tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "tokens": self.tokens}


def block_bytes(loaded, block_size: int, kv_cache_dtype: str, tensor_parallel_size: int = 1) -> tuple[str, int]:
    """(stored dtype, bytes per block) of an engine's pool, as LLMEngine computes them."""
    from pallas_kernels.kv_quant import kv_storage_dtype
    from zipage_jax.engine.pool_plan import kv_block_bytes

    mc = loaded.config
    dtype = kv_storage_dtype(kv_cache_dtype, loaded.model.dtype)
    kv_heads = -(-mc.num_kv_heads // tensor_parallel_size)  # per device
    return dtype.name, kv_block_bytes(mc.num_layers, block_size, kv_heads, mc.head_dim, dtype)


def size_pools(workload: Workload, loaded, kv_cache_dtypes: list[str], tensor_parallel_size: int = 1
               ) -> dict[str, Pool]:
    """One pool per KV dtype, all of the same bytes: the workload's pool in blocks of the first
    dtype (or `pool_gb`), and as many blocks of each other dtype as those bytes hold."""
    sizes = {d: block_bytes(loaded, workload.block_size, d, tensor_parallel_size) for d in kv_cache_dtypes}
    first = sizes[kv_cache_dtypes[0]][1]
    total = int(workload.pool_gb * 2**30) if workload.pool_gb else (workload.num_pool_blocks - 1) * first
    pools = {d: Pool(d, name, size, total // size + 1, workload.block_size) for d, (name, size) in sizes.items()}
    workload.check_fits(min(p.blocks for p in pools.values()))
    return pools


def make_prompts(tokenizer, workload: Workload) -> list[list[int]]:
    """Mixed-length prompts, each a different window of real text (no shared prefixes)."""
    with open(argparse.__file__, encoding="utf-8") as f:
        tokens = list(tokenizer(f.read())["input_ids"])
    if len(tokens) < workload.prompt_len_max:
        raise ValueError(f"the source text has only {len(tokens)} tokens")
    rng = np.random.default_rng(workload.seed)
    lengths = np.linspace(workload.prompt_len_min, workload.prompt_len_max, workload.requests).round().astype(int)
    rng.shuffle(lengths)
    stride = max(1, (len(tokens) - workload.prompt_len_max) // workload.requests)
    return [tokens[i * stride:i * stride + n] for i, n in enumerate(lengths)]


def engine_config(model: str, workload: Workload, compressed: bool, options: dict, pool: Pool,
                  scoring: dict = RECOMMENDED_SCORING):
    """The engine of one run: `options`, then the workload's sizes and `pool`; compressed runs
    get `scoring` (under the options) and the workload's budget, or with the option
    `auto_budget` an automatic budget whose ceiling is the workload's budget (unless
    `auto_budget_max` says otherwise), beside the prompt where `auto_budget_keeps_prompt` keeps it."""
    from zipage_jax import EngineConfig

    base = dict(max_num_seqs=workload.requests, max_model_len=workload.prompt_len_max + workload.max_tokens)
    base.update({k: v for k, v in options.items() if k != "kvcache_memory_gb"})
    base.update(model=model, kvcache_block_size=workload.block_size, num_kvcache_blocks=pool.blocks,
                kv_cache_dtype=pool.kv_cache_dtype)
    if compressed and base.get("auto_budget"):
        base = {**scoring, "auto_budget_max": workload.budget_blocks * workload.block_size, **base,
                "max_cache_blocks_per_seq": None}
    elif compressed:
        base = {**scoring, **base, "max_cache_blocks_per_seq": workload.budget_blocks}
    else:
        base.update(max_cache_blocks_per_seq=None, auto_budget=False)
    return EngineConfig.from_options(**base)


def add_workload_arguments(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The flags every workload has: --quick, --requests, --max-tokens, --prompt-len."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--requests", type=int, help="requests in the workload (default: the preset's)")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens, drawn between MIN and MAX (default: the preset's)")


def workload_overrides(args: argparse.Namespace) -> dict:
    """The add_workload_arguments flags as workload fields (None: the preset's)."""
    return {"requests": args.requests, "max_tokens": args.max_tokens,
            "prompt_len_min": args.prompt_len[0] if args.prompt_len else None,
            "prompt_len_max": args.prompt_len[1] if args.prompt_len else None}
