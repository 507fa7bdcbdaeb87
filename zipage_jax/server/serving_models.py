"""The routes about the server itself: /health, /v1/models, /v1/models/{model_id}, /version and
/metrics (Prometheus)."""

from __future__ import annotations

import functools
import importlib.metadata

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.responses import Health, ModelCard, ModelList, Version
from zipage_jax.server.serving import OpenAIServing


def health(serving: OpenAIServing) -> JSONResponse:
    """{"status": "ok"} once the engine serves, else the 503 that says why."""
    try:
        serving.ready_engine()
        if not serving.client.healthy:  # a failed engine is refused above
            raise OpenAIError(503, serving.client.unhealthy_reason)
    except OpenAIError as exc:
        return exc.response()
    return JSONResponse(Health(status="ok").body())


def list_models(serving: OpenAIServing) -> JSONResponse:
    cards = [_card(serving, name) for name in serving.served.names]
    return JSONResponse(ModelList(object="list", data=cards).body())


def retrieve_model(serving: OpenAIServing, model_id: str) -> JSONResponse:
    serving.served.check(model_id)
    return JSONResponse(_card(serving, model_id).body())


def version() -> JSONResponse:
    return JSONResponse(Version(version=package_version()).body())


def metrics(serving: OpenAIServing) -> Response:
    return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@functools.cache
def package_version() -> str:
    try:
        return importlib.metadata.version("zipage-jax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _card(serving: OpenAIServing, name: str) -> ModelCard:
    return serving.served.card(name, serving.max_model_len())
