"""zipage-jax serve: the OpenAI-compatible server.

    zipage-jax serve --model default --port 8000 --kvcache-block-size 32 --max-cache-blocks-per-seq 8

Every EngineConfig and ServerConfig field is a flag (--max-num-seqs, --num-kvcache-blocks,
--port, ...), its help the field's documentation. The server answers at once; /health is 503
until the model has loaded and the largest compiled program of each kind is built, then 200:
the server warms up in the background (the other programs build behind those) unless
--no-warmup, with which steps compile what they need on first use. Exits
with status 1 if the model fails to load, or once the engine fails for good (a failed device
step it could not recover from). Prompts and stop strings per request are unbounded unless a
--max-* flag below bounds them, as in vLLM; chat messages, their text and the queue have
generous bounds. With --api-key (or ZIPAGE_API_KEY / VLLM_API_KEY) the /v1 and tokenizer
routes need `Authorization: Bearer KEY`. docs/openai-compatibility.md lists every parameter and
route.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

import uvicorn

from zipage_jax.cli_options import (
    add_distributed_arguments,
    add_engine_arguments,
    add_field_argument,
    engine_options,
    start_distributed,
)
from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.server import create_app
from zipage_jax.server.auth import api_key_from
from zipage_jax.server.config import ServerConfig, server_option_fields

_WARMUP_HELP = ("build every compiled program in the background once the model has loaded, the largest of each "
                "kind first; /health, generation and tokenizer routes answer 503 until those are ready (default: "
                "on; --no-warmup: serve at once, compiling programs when the first requests need them)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for field, kind in server_option_fields():
        add_field_argument(parser, field, kind)
    add_engine_arguments(parser, help={"warmup": _WARMUP_HELP})
    add_distributed_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if (args.num_processes or 1) > 1:
        _usage_error("the server runs its engine in one process (use --tensor-parallel-size over this host's "
                     "devices); multi-process runs: python -m zipage_jax generate")
    options = engine_options(args)
    options.setdefault("model", "default")
    warmup = options.pop("warmup", True)  # the server warms up in the background, not in the engine's constructor
    options["warmup"] = False

    def stop(exc: BaseException) -> None:  # the model failed to load, or the engine failed
        server.should_exit = True

    try:  # bad flags fail here, before binding the port
        EngineConfig.from_options(**options)
        config = ServerConfig.from_options(**{field.name: getattr(args, field.name)
                                              for field, _ in server_option_fields()})
        app = create_app(lambda: LLMEngine(**options), config.served_model_name or [options["model"]],
                         stop, max_n=config.max_n, max_request_bytes=config.max_request_bytes, limits=config.limits,
                         on_engine_error=stop, max_queued_requests=config.max_queued_requests,
                         api_key=api_key_from(config.api_key, os.environ), warmup=warmup)
        start_distributed(args)
    except ValueError as exc:
        _usage_error(str(exc))

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level))
    server.run()
    engine_loop = app.state.engine_loop
    return 1 if engine_loop.load_error is not None or engine_loop.engine_error is not None else 0


def _usage_error(message: str) -> NoReturn:
    print(f"zipage-jax serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)
