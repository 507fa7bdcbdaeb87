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

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    """Raises ValueError for a bad limit; create_app checks the others."""

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
    api_key: str | None = option(
        None, metavar="KEY",
        doc="the key clients must send as `Authorization: Bearer KEY` to the /v1 and tokenizer routes (/health, "
            f"/metrics, /version, /openapi.json and /docs stay open); default: ${KEY_VARIABLES[0]}, else "
            f"${KEY_VARIABLES[1]}, else none (no key needed)")

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
