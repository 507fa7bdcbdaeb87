"""ServedModels: the names clients may give the one model this server runs, as OpenAI model
objects, and the 404 for any other name."""

from __future__ import annotations

import time

from zipage_jax.server.errors import OpenAIError
from zipage_jax.server.responses import ModelCard


class ServedModels:
    def __init__(self, names: list[str]):
        if not names:
            raise ValueError("served_model_names is empty")
        self.names = list(names)
        self.created = int(time.time())

    def check(self, name: str) -> None:
        """OpenAIError 404 (code model_not_found) unless `name` is served."""
        if name not in self.names:
            raise OpenAIError(404, f"The model `{name[:100]}` does not exist. Served: {', '.join(self.names)}.",
                              param="model", code="model_not_found")

    def card(self, name: str, max_model_len: int | None) -> ModelCard:
        """The model object of /v1/models; max_model_len is None while the model loads."""
        return ModelCard(id=name, object="model", created=self.created, owned_by="zipage-jax",
                         max_model_len=max_model_len)
