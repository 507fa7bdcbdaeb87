"""Compiled executables on disk, so a restart neither traces nor compiles.

JAX's persistent compilation cache skips XLA's compile but still traces and lowers every
program; this store keeps the executables themselves (`jax.experimental.serialize_executable`)
and loads them without tracing. The engine does not use JAX's cache at all: on CPU an
executable JAX loaded from it serializes without some of its functions, and the stored copy
then fails when it runs ("Function ... not found"). An entry is keyed by everything that shapes a program: the
engine's device-side options, the model's config and parameter shapes, the jax and jaxlib
versions, the backend and its devices, XLA_FLAGS and the source of the engine itself. A program
whose entry is missing or does not load is compiled as usual (and stored).

The default directory is per host CPU (`host_fingerprint`): an executable compiled for another
CPU's instruction set crashes the process that loads it (a cache copied between machines, a
shared home).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import platform
from pathlib import Path

import jax
import jaxlib
import xxhash
from jax.experimental import serialize_executable

from zipage_jax.config import EngineConfig
from zipage_jax.models.config import ModelConfig
from zipage_jax.models.param_cache import default_cache_dir

logger = logging.getLogger("zipage_jax")

_PACKAGES = ("zipage_jax", "pallas_kernels")
_FORMAT = 1  # bump when the entry layout changes
# EngineConfig fields that shape no compiled program (host-side scheduling and logging)
HOST_ONLY_OPTIONS = frozenset({"model", "revision", "download_dir", "warmup", "log_interval_s", "compilation_cache_dir",
                               "enable_prefix_caching", "async_scheduling", "profile_compaction", "seed"})


def store_directory(option: str | None) -> Path | None:
    """The directory `EngineConfig.compilation_cache_dir` names: None, the default; "": none (off)."""
    if option == "":
        return None
    return default_directory() if option is None else Path(option)


def default_directory() -> Path:
    return default_cache_dir() / "executables" / host_fingerprint()


def host_fingerprint(cpuinfo: str | None = None) -> str:
    """A short hash of this machine's CPU model and instruction-set flags (from `cpuinfo`, by
    default /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = platform.processor()
    lines = cpuinfo.splitlines()
    identity = sorted({line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))})
    return xxhash.xxh64("\n".join([platform.machine(), *identity]).encode()).hexdigest()[:12]


def _hash_sources() -> str:
    h = xxhash.xxh64()
    root = Path(__file__).resolve().parents[3]
    for package in _PACKAGES:
        for f in sorted((root / package).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


_SOURCE_FINGERPRINT = _hash_sources()  # at import: the source this process runs, not what is on disk later


def source_fingerprint() -> str:
    """A hash of the engine's own Python source as this process imported it (a changed kernel
    must not load an old program, and a process must not store its programs under the key of
    source edited on disk while it runs)."""
    return _SOURCE_FINGERPRINT


def program_key(engine_options: object, model_config: object, param_shapes: list, devices: list) -> str:
    """The store key of one engine's programs (a dataclass of options, the model's config)."""
    options = {k: v for k, v in dataclasses.asdict(engine_options).items() if k not in HOST_ONLY_OPTIONS}
    parts = [f"format {_FORMAT}", f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}",
             f"backend {jax.default_backend()}", f"devices {[d.device_kind for d in devices]}",
             f"processes {jax.process_count()}", f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
             f"source {source_fingerprint()}", f"options {sorted(options.items())!r}", f"model {model_config!r}",
             f"params {param_shapes!r}"]
    return xxhash.xxh64("\n".join(parts).encode()).hexdigest()


def engine_store(config: EngineConfig, model_config: ModelConfig, params: object) -> ExecutableStore | None:
    """The store of one engine's programs (`params`: its parameters, a pytree); None when the
    store is off, or with several processes (each compiles its own)."""
    root = store_directory(config.compilation_cache_dir)
    if root is None or jax.process_count() > 1:
        return None
    shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)]
    devices = jax.devices()[:config.tensor_parallel_size]
    return ExecutableStore(root / program_key(config, model_config, shapes, devices), devices)


class ExecutableStore:
    """One directory of serialized executables, a file per (program name, shape bucket), loaded
    onto the engine's `devices` (by default JAX would load them onto every device it sees, and a
    one-device program on a machine of several then asks for a shard per device)."""

    def __init__(self, directory: Path, devices: list):
        self.directory = directory
        self.devices = devices

    def _path(self, name: str, key: tuple) -> Path:
        return self.directory / (f"{name}-" + "-".join(str(k).replace(" ", "_") for k in key) + ".bin")

    def load(self, name: str, key: tuple):
        """The stored executable, or None when there is none or it does not load."""
        path = self._path(name, key)
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=self.devices)
        except Exception as exc:  # noqa: BLE001 - a stale or damaged entry is compiled again
            logger.warning("could not load the stored %s program %s (%s): compiling it", name, key, exc)
            return None

    def save(self, name: str, key: tuple, compiled) -> None:
        """Writes the executable (a failure to serialize or write only logs: the program still runs)."""
        path = self._path(name, key)
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}-{id(compiled)}")
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # a present entry is complete
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not store the %s program %s: %s", name, key, exc)
