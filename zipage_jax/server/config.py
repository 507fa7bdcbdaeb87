"""ServerConfig: the server's options besides the engine's, each documented in its field, which
`zipage-jax serve` turns into its flags and their help (zipage_jax/commands/serve.py)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from zipage_jax.config import option
from zipage_jax.sampling_params import MAX_N
from zipage_jax.server.auth import KEY_VARIABLES
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.middleware import DEFAULT_MAX_REQUEST_BYTES
from zipage_jax.server.queue_capacity import DEFAULT_MAX_QUEUED_REQUESTS
from zipage_jax.server.reasoning_parsers import REASONING_PARSERS
from zipage_jax.server.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")
DATA_PARALLEL_BACKENDS = ("ray",)
ROUTING_POLICIES = ("cache_aware", "round_robin")  # data_parallel.router's (the server does not import it)


@dataclass(frozen=True)
class ServerConfig:
    """Raises ValueError for a bad limit or shutdown timeout; create_app checks the others."""

    host: str = option("127.0.0.1", doc="interface to bind")
    port: int = option(8000, doc="TCP port to listen on")
    served_model_name: list[str] | None = option(
        None, nargs="+", metavar="NAME", doc="model name(s) clients use (default: the --model argument)")
    log_level: str = option("info", choices=LOG_LEVELS, doc="the server's and uvicorn's log level")
    max_n: int = option(MAX_N, metavar="N", doc=f"most completions per prompt a request may ask for (1 to {MAX_N}; "
                                                "the engine also caps n at --max-num-seqs)")
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                                    doc="the most bytes of a request body (4 MiB by default); a larger one is "
                                        "answered 413 unread")
    limits: RequestLimits = option(default_factory=RequestLimits, doc="bounds on the counts in one request")
    max_queued_requests: int = option(
        DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
        doc="the most sequences (prompts x n) admitted and waiting for their first token; a generation request that "
            "would make more wait is answered 503 with Retry-After")
    shutdown_timeout: float = option(
        30.0, metavar="SECONDS",
        doc="on SIGTERM or SIGINT the server stops admitting (new requests and /health answer 503) and lets the "
            "requests in flight finish for at most this long, then aborts those left (a 503 error, or an error event "
            "ending the stream) and exits; 0: abort them at once; a second signal aborts at once too")
    stream_interval: int = option(
        1, metavar="N", doc="tokens of a streamed completion per chunk (the last chunk may hold fewer): 1 sends every "
                            "token as it comes; a larger N costs the server's process less per token at high "
                            "concurrency, each client seeing its text N tokens at a time (vLLM's --stream-interval)")
    data_parallel_size: int = option(
        1, metavar="N", doc="engine replicas behind this server, each in its own process with its own devices "
                            "(--tensor-parallel-size each), run by --data-parallel-backend; 1: one engine in this "
                            "process")
    data_parallel_backend: str = option(
        "ray", choices=DATA_PARALLEL_BACKENDS,
        doc="what runs the replicas of --data-parallel-size: ray (the only one): a local Ray instance, or the "
            "cluster $RAY_ADDRESS names")
    routing_policy: str = option(
        "cache_aware", choices=ROUTING_POLICIES,
        doc="which replica a request goes to: cache_aware (the one that holds the longest run of the prompt's "
            "leading blocks, when above 30% of them, unless the replicas' tokens in flight are unbalanced; else the "
            "least loaded) or round_robin")
    api_key: str | None = option(
        None, metavar="KEY",
        doc="the key clients must send as `Authorization: Bearer KEY` to the /v1 and tokenizer routes (/health, "
            f"/metrics, /version, /openapi.json and /docs stay open); default: ${KEY_VARIABLES[0]}, else "
            f"${KEY_VARIABLES[1]}, else none (no key needed)")
    enable_auto_tool_choice: bool = option(
        False, doc='serve tool_choice "auto" (the default of a chat request with tools): the output is free and '
                   "--tool-call-parser reads the tool calls out of it (a tool with strict: true constrains them to its "
                   'parameters); without it such a request is answered 400; needs --tool-call-parser')
    tool_call_parser: str | None = option(
        None, choices=tuple(TOOL_PARSERS), metavar="NAME",
        doc="the format of the model's tool calls, for --enable-auto-tool-choice: hermes (Hermes, Qwen2.5, Qwen3: "
            "<tool_call>{...}</tool_call>), llama3_json (Llama 3.1/3.2: the output is JSON calls separated by ';'), "
            "pythonic (Gemma 3: the output is a Python list of calls, [f(a=1)]), openai (gpt-oss: harmony's "
            "commentary-channel calls to functions.NAME)")
    reasoning_parser: str | None = option(
        None, choices=tuple(REASONING_PARSERS), metavar="NAME",
        doc="split each chat completion's <think> block off into message.reasoning_content (and delta."
            "reasoning_content), count it in usage.completion_tokens_details.reasoning_tokens, and apply a "
            "response_format, structured_outputs or tool grammar after it: deepseek_r1 (DeepSeek-R1, QwQ: the text up "
            "to </think> is reasoning, all of it without one), qwen3 (Qwen3: reasoning only in a <think> block at the "
            "start), openai_gptoss (gpt-oss: harmony's analysis channel is reasoning, its final channel content); "
            "default: none, the output is all content")

    def __post_init__(self) -> None:
        if not self.shutdown_timeout >= 0:  # NaN too
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout:g}")

    @classmethod
    def from_options(cls, **options) -> ServerConfig:
        """The config from flat options: its fields and RequestLimits', by name."""
        limit_names = {f.name for f in dataclasses.fields(RequestLimits)}
        limits = RequestLimits(**{name: options.pop(name) for name in list(options) if name in limit_names})
        return cls(**options, limits=limits)


def server_option_fields() -> list[tuple[dataclasses.Field, object]]:
    """(field, type) of every flat option `ServerConfig.from_options` takes, RequestLimits' in
    the place of `limits`."""
    hints = {**typing.get_type_hints(ServerConfig), **typing.get_type_hints(RequestLimits)}
    flat: list[dataclasses.Field] = []
    for f in dataclasses.fields(ServerConfig):
        flat += dataclasses.fields(RequestLimits) if f.name == "limits" else [f]
    return [(f, hints[f.name]) for f in flat]
