"""On-disk cache of converted parameters (orbax), keyed by a fingerprint of the source files.

An entry `<root>/<key>/` holds `params/` (orbax), `hf_config.json` and `tokenizer/`; it is
written under a temporary name and renamed into place, so a present entry is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
import xxhash

FORMAT_VERSION = 3  # bump when the parameter layout changes (3: q/k/v_proj fused into qkv_proj)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ZIPAGE_JAX_CACHE") or Path.home() / ".cache" / "zipage_jax")


def fingerprint(files: list[Path], dtype: str) -> str:
    """Changes when any file's path, size or mtime, the dtype or the cache format changes. A
    symlink counts as the file it points to: a Hugging Face snapshot's files link to its blobs,
    named by their content, so another revision with other contents is another key."""
    h = xxhash.xxh64()
    for f in sorted(files):
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{dtype}|v{FORMAT_VERSION}".encode())
    return h.hexdigest()


class ParamCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def hf_config(self, key: str) -> dict | None:
        """The entry's config dict, or None when `key` is not cached."""
        f = self.root / key / "hf_config.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def restore_params(self, key: str, shapes: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        args = ocp.args.PyTreeRestore(restore_args=ocp.checkpoint_utils.construct_restore_args(shapes))
        with ocp.PyTreeCheckpointer() as ckpt:
            return ckpt.restore((self.root / key / "params").resolve(), args=args)

    def tokenizer_dir(self, key: str) -> Path:
        return self.root / key / "tokenizer"

    def save(self, key: str, hf_config: dict, params: dict[str, jax.Array], tokenizer: Any) -> None:
        entry = self.root / key
        tmp = self.root / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with ocp.PyTreeCheckpointer(use_compression=False) as ckpt:  # zstd would double restore time
            ckpt.save((tmp / "params").resolve(), params)
        (tmp / "hf_config.json").write_text(json.dumps(hf_config))
        tokenizer.save_pretrained(tmp / "tokenizer")
        try:
            os.replace(tmp, entry)
        except OSError:  # another process filled the entry first
            shutil.rmtree(tmp, ignore_errors=True)
