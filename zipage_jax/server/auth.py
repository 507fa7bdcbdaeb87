"""ApiKey: vLLM's --api-key. Every /v1 route and the tokenizer routes need
`Authorization: Bearer KEY`, else a 401 in OpenAI's form (code invalid_api_key); /health,
/metrics, /version, /openapi.json and /docs stay open. The key is compared in constant time
(as SHA-256 digests, so its length does not show either).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from zipage_jax.server.errors import OpenAIError

KEY_VARIABLES = ("ZIPAGE_API_KEY", "VLLM_API_KEY")  # read when --api-key is not given, in this order
_TOKENIZER_ROUTES = ("/tokenize", "/detokenize")


def requires_key(path: str) -> bool:
    """Whether a request to `path` must carry the key (when the server has one)."""
    return path == "/v1" or path.startswith("/v1/") or path in _TOKENIZER_ROUTES


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The server's key: the flag, else the first of KEY_VARIABLES set non-empty, else None."""
    if flag is not None:
        return flag
    return next((environ[name] for name in KEY_VARIABLES if environ.get(name)), None)


class ApiKey:
    def __init__(self, key: str):
        if not key or not all("!" <= c <= "~" for c in key):
            raise ValueError("api_key must be a non-empty string of visible ASCII characters (no spaces)")
        self._digest = _digest(key)

    def check(self, path: str, authorization: bytes | None) -> None:
        """OpenAIError 401 unless `path` is open or `authorization` (the header's value) is
        "Bearer <the key>"."""
        if not requires_key(path):
            return
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._digest):
            return
        message = ("Incorrect API key provided." if authorization else
                   "You didn't provide an API key: send it as `Authorization: Bearer YOUR_KEY`.")
        raise OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("latin-1", "replace")).digest()
