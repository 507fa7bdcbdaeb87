"""The step relay's handshake: before anything else crosses a relay connection, the follower and
process 0 each prove they hold the group's secret, without sending it.

    process 0 -> follower: MAGIC, nonce0 (32 random bytes)
    follower -> process 0: nonce1 (32 random bytes), HMAC-SHA256(secret, FOLLOWER_LABEL nonce0 nonce1)
    process 0 -> follower: HMAC-SHA256(secret, LEADER_LABEL nonce0 nonce1)

Each side reads fixed sizes by a deadline and compares digests in constant time; a side that
fails closes the connection (RelayAuthError). The secret: ZIPAGE_RELAY_SECRET, or the file
serve's --relay-secret-file names (the file wins), at least MIN_SECRET_CHARS characters.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path

from zipage_jax.engine.runner.relay_wire import RelayProtocolError, read_exactly

SECRET_ENV = "ZIPAGE_RELAY_SECRET"
MIN_SECRET_CHARS = 16
MAGIC = b"ZJRELAY1"
NONCE_SIZE = 32
DIGEST_SIZE = hashlib.sha256().digest_size
FOLLOWER_LABEL = b"zipage-jax relay: follower"
LEADER_LABEL = b"zipage-jax relay: process 0"


class RelayAuthError(RelayProtocolError):
    """The other end of a relay connection did not prove it holds the group's secret."""


def relay_secret(environ: Mapping[str, str], path: str | None) -> bytes | None:
    """The group's secret from the file at `path`, else from environ[SECRET_ENV]; None when
    neither is given. ValueError for a file that cannot be read or a secret too short."""
    if path is not None:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the relay secret file {path}: {exc}") from exc
        return _checked(text.strip(), f"the relay secret file {path}")
    if SECRET_ENV in environ:
        return _checked(environ[SECRET_ENV].strip(), SECRET_ENV)
    return None


def new_secret() -> str:
    """A fresh secret for a group none was given to."""
    return secrets.token_urlsafe(32)


def _checked(secret: str, source: str) -> bytes:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the relay secret ({source}) must be at least {MIN_SECRET_CHARS} characters, "
                         f"got {len(secret)}")
    return secret.encode()


def _digest(secret: bytes, label: bytes, nonce0: bytes, nonce1: bytes) -> bytes:
    return hmac.new(secret, label + nonce0 + nonce1, hashlib.sha256).digest()


def prove_leader(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Process 0's side, on a connection just accepted: RelayAuthError when the peer's proof is
    wrong; EOFError / TimeoutError when it leaves or is too slow."""
    nonce0 = secrets.token_bytes(NONCE_SIZE)
    sock.sendall(MAGIC + nonce0)
    answer = read_exactly(sock, NONCE_SIZE + DIGEST_SIZE, deadline)
    nonce1, proof = answer[:NONCE_SIZE], answer[NONCE_SIZE:]
    if not hmac.compare_digest(proof, _digest(secret, FOLLOWER_LABEL, nonce0, nonce1)):
        raise RelayAuthError("it did not prove it holds the group's relay secret")
    sock.sendall(_digest(secret, LEADER_LABEL, nonce0, nonce1))


def read_greeting(sock: socket.socket, deadline: float) -> bytes:
    """A follower's first read: process 0's nonce. EOFError / TimeoutError when process 0 closes
    the connection or says nothing (it is not accepting yet: try again); RelayAuthError when the
    port is not a zipage-jax relay."""
    greeting = read_exactly(sock, len(MAGIC) + NONCE_SIZE, deadline)
    if not greeting.startswith(MAGIC):
        raise RelayAuthError("the relay port answered, but not as a zipage-jax relay")
    return greeting[len(MAGIC):]


def prove_follower(sock: socket.socket, secret: bytes, nonce0: bytes, deadline: float) -> None:
    """A follower's side after read_greeting: RelayAuthError when process 0 refuses this
    process's proof or does not prove it holds the secret itself."""
    nonce1 = secrets.token_bytes(NONCE_SIZE)
    sock.sendall(nonce1 + _digest(secret, FOLLOWER_LABEL, nonce0, nonce1))
    try:
        proof = read_exactly(sock, DIGEST_SIZE, deadline)
    except (EOFError, OSError) as exc:
        raise RelayAuthError(f"process 0 refused this process ({type(exc).__name__}: {exc}): every process "
                             f"needs the same relay secret ({SECRET_ENV} or --relay-secret-file)") from exc
    if not hmac.compare_digest(proof, _digest(secret, LEADER_LABEL, nonce0, nonce1)):
        raise RelayAuthError("the relay did not prove it holds the group's secret: it is not process 0 "
                             "of this group, or its secret differs")
