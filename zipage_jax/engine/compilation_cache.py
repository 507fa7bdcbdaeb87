"""JAX's persistent compilation cache, in a directory per host CPU."""

from __future__ import annotations

import platform
from pathlib import Path

import jax
import xxhash

from zipage_jax.models.param_cache import default_cache_dir


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache, so a restart does not compile every bucket again.

    The default directory is per host CPU (`host_fingerprint`): JAX's cache key names the
    platform but not the CPU model, and an executable compiled for another CPU's instruction set
    crashes the process that loads it (a cache copied between machines, a shared home)."""
    if directory == "" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(default_directory() if directory is None else directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def default_directory() -> Path:
    return default_cache_dir() / "xla" / host_fingerprint()


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
