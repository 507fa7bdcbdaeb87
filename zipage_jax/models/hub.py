"""Hugging Face model ids ("org/name") -> a snapshot directory in huggingface_hub's cache.

    path = snapshot_dir("Qwen/Qwen3-0.6B")                      # revision main, the default cache
    path = snapshot_dir("Qwen/Qwen3-0.6B", revision="v2", download_dir="/data/hf")

Only what the engine reads is fetched: config.json, generation_config.json, the tokenizer files,
then the safetensors weights the snapshot lacks (model.safetensors, or the shards
model.safetensors.index.json names). A cached model loads without the network: always with HF_HUB_OFFLINE=1, and online
whenever the Hub cannot be reached. HF_HUB_OFFLINE, HF_HUB_CACHE and HF_HOME are read at each
call, so setting them after huggingface_hub was imported takes effect too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from zipage_jax.models.safetensors_dir import INDEX_FILE, weight_file_names

CONFIG_AND_TOKENIZER_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    INDEX_FILE,
]
LOGIN_HINT = "log in with `hf auth login` or set HF_TOKEN"

logger = logging.getLogger("zipage_jax")


class HubModelError(FileNotFoundError):
    """A Hugging Face model id whose files could not be had: not cached while offline or unreachable,
    not on the Hub, gated, or without safetensors weights."""


def is_repo_id(model: str) -> bool:
    """Whether `model` is spelt as a Hub model id, "org/name" (a path starting with /, . or ~, or a
    .gguf file, is not)."""
    if model.count("/") != 1 or model.startswith(("/", ".", "~")) or model.endswith(".gguf"):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def default_download_dir() -> Path:
    """huggingface_hub's cache as the environment names it now: $HF_HUB_CACHE, else $HF_HOME/hub, else
    the one huggingface_hub chose at import (~/.cache/huggingface/hub unless the environment said otherwise)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE as set now, or as it was when huggingface_hub was imported."""
    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def snapshot_dir(repo_id: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local snapshot of `repo_id` at `revision` (a branch, tag or commit hash; default main) in
    `download_dir` (default: `default_download_dir()`), downloading the files it lacks unless offline."""
    cache = Path(download_dir).expanduser() if download_dir is not None else default_download_dir()
    model = f"Hugging Face model {repo_id!r} (revision {revision or constants.DEFAULT_REVISION!r})"
    snapshot = _download(repo_id, revision, cache, CONFIG_AND_TOKENIZER_FILES, model)
    if not (snapshot / "config.json").is_file():
        raise HubModelError(f"{model} has no config.json (in {snapshot}): zipage-jax loads transformers models "
                            "with safetensors weights; for a GGUF repository download the .gguf file and pass its path")
    weights = weight_file_names(snapshot)
    if any(not (snapshot / name).is_file() for name in weights):
        # by the snapshot's commit hash: the same snapshot, without asking the Hub what the revision is again
        snapshot = _download(repo_id, snapshot.name, cache, weights, model)
    missing = [name for name in weights if not (snapshot / name).is_file()]
    if missing:
        raise HubModelError(f"{model} lacks {', '.join(missing)} in {snapshot}: zipage-jax reads safetensors weights "
                            "only (model.safetensors or the shards of model.safetensors.index.json); if the Hub has "
                            "them, download them with network access (HF_HUB_OFFLINE unset)")
    logger.info("%s: %s", model, snapshot)
    return snapshot


def _download(repo_id: str, revision: str | None, cache: Path, patterns: list[str], model: str) -> Path:
    """snapshot_download of the files matching `patterns`; its errors as HubModelError, naming `model`."""
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                      local_files_only=offline()))
    except LocalEntryNotFoundError as exc:
        why, fetch = (("HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it") if offline() else
                      ("the Hugging Face Hub could not be reached", "download it with network access"))
        raise HubModelError(
            f"{model} is not (completely) in the cache {cache} and {why}: {fetch}, give the cache that holds it "
            f"(--download-dir / download_dir, or HF_HUB_CACHE / HF_HOME), or pass a local model directory; a gated "
            f"or private model needs a login too ({LOGIN_HINT})"
        ) from exc
    except GatedRepoError as exc:
        raise HubModelError(f"{model} is gated: accept its conditions on https://huggingface.co/{repo_id}, then "
                            f"{LOGIN_HINT}") from exc
    except RepositoryNotFoundError as exc:
        raise HubModelError(f"{model} is neither a local path nor a model on the Hugging Face Hub (if it is private, "
                            f"{LOGIN_HINT})") from exc
    except RevisionNotFoundError as exc:
        raise HubModelError(f"{model}: the Hub has no such revision (a branch, tag or commit hash)") from exc
    except HfHubHTTPError as exc:
        raise HubModelError(f"{model} could not be fetched: {exc} (a gated or private model needs a login: "
                            f"{LOGIN_HINT})") from exc
