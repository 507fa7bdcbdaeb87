"""OpenAI-compatible server for zipage-jax.

    python scripts/serve_jax.py --model default --port 8000 --kvcache-block-size 32 --max-cache-blocks-per-seq 8

Every EngineConfig field is a flag (--max-num-seqs, --num-kvcache-blocks, ...). The server
answers at once; /health is 503 until the model has loaded and the largest compiled program of
each kind is built, then 200: the server warms up in the background (the other programs build
behind those) unless --no-warmup, with which steps compile what they need on first use. Exits
with status 1 if the model fails to load, or once the engine fails for good (a failed device
step it could not recover from). Prompts and stop strings per request are unbounded unless a
--max-* flag below bounds them, as in vLLM; chat messages, their text and the queue have
generous bounds. With --api-key (or ZIPAGE_API_KEY / VLLM_API_KEY) the /v1 and tokenizer
routes need `Authorization: Bearer KEY`. docs/openai-compatibility.md lists every parameter and
route.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import uvicorn

from zipage_jax.cli_options import add_distributed_arguments, add_engine_arguments, engine_options, start_distributed
from zipage_jax.config import EngineConfig
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.sampling_params import MAX_N
from zipage_jax.server import create_app
from zipage_jax.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, QUEUE_FLAG
from zipage_jax.server.auth import KEY_VARIABLES, api_key_from
from zipage_jax.server.limits import FLAGS, RequestLimits
from zipage_jax.server.middleware import DEFAULT_MAX_REQUEST_BYTES

# What each RequestLimits flag bounds.
_LIMITS_HELP = {
    "max_prompts": "prompts in one /v1/completions request (without a bound, any number are queued under "
                   "--max-num-seqs)",
    "max_stop_strings": "stop strings in one request (each costs the stop checker work per generated token: bound "
                        "it when clients are not trusted)",
    "max_stop_chars": "characters in one stop string",
    "max_chat_messages": "messages in one chat request (and in /tokenize's chat form)",
    "max_chat_bytes": "bytes of text in one chat request's messages (and in /tokenize's chat form): every string "
                      "field of every message, plus 32 per message, counted before the template renders them",
}
_WARMUP_HELP = ("build every compiled program in the background once the model has loaded, the largest of each "
                "kind first; /health, generation and tokenizer routes answer 503 until those are ready (default: "
                "on; --no-warmup: serve at once, compiling programs when the first requests need them)")
_LIMITS_DEFAULT = {f.name: f.default for f in dataclasses.fields(RequestLimits)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="model name(s) clients use (default: the --model argument)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--max-n", type=int, default=MAX_N, metavar="N",
                        help=f"most completions per prompt a request may ask for (1 to {MAX_N}; the engine also "
                             f"caps n at --max-num-seqs; default: {MAX_N})")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help="larger request bodies are answered 413 unread "
                             f"(default: {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB)")
    for field, flag in FLAGS.items():
        default = _LIMITS_DEFAULT[field]
        parser.add_argument(flag, dest=field, type=int, default=default, metavar="N",
                            help=f"the most {_LIMITS_HELP[field]}; more is answered 400 "
                                 f"(default: {'unbounded' if default is None else default})")
    parser.add_argument(QUEUE_FLAG, type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                        help="the most sequences (prompts x n) admitted and waiting for their first token; a "
                             "generation request that would make more wait is answered 503 with Retry-After "
                             f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})")
    parser.add_argument("--api-key", metavar="KEY",
                        help="the key clients must send as `Authorization: Bearer KEY` to the /v1 and tokenizer "
                             "routes (/health, /metrics, /version, /openapi.json and /docs stay open); default: "
                             f"${KEY_VARIABLES[0]}, else ${KEY_VARIABLES[1]}, else none (no key needed)")
    add_engine_arguments(parser, help={"warmup": _WARMUP_HELP})
    add_distributed_arguments(parser)
    args = parser.parse_args(argv)
    if (args.num_processes or 1) > 1:
        parser.error("the server runs its engine in one process (use --tensor-parallel-size over this host's "
                     "devices); multi-process runs: python -m zipage_jax generate")
    options = engine_options(args)
    options.setdefault("model", "default")
    warmup = options.pop("warmup", True)  # the server warms up in the background, not in the engine's constructor
    options["warmup"] = False

    def stop(exc: BaseException) -> None:  # the model failed to load, or the engine failed
        server.should_exit = True

    try:  # bad flags fail here, before binding the port
        EngineConfig.from_options(**options)
        limits = RequestLimits(**{field: getattr(args, field) for field in FLAGS})
        app = create_app(lambda: LLMEngine(**options), args.served_model_name or [options["model"]],
                         stop, max_n=args.max_n, max_request_bytes=args.max_request_bytes, limits=limits,
                         on_engine_error=stop, max_queued_requests=args.max_queued_requests,
                         api_key=api_key_from(args.api_key, os.environ), warmup=warmup)
        start_distributed(args)
    except ValueError as exc:
        parser.error(str(exc))

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()
    engine_loop = app.state.engine_loop
    return 1 if engine_loop.load_error is not None or engine_loop.engine_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
