"""The default compilation-cache directory is per host CPU."""

from __future__ import annotations

from zipage_jax.engine import compilation_cache

AVX512 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx2 avx512f\ncpu MHz\t\t: 2000\n"
AVX2 = "processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse avx2\ncpu MHz\t\t: 2000\n"


def test_the_fingerprint_follows_the_instruction_set_not_the_clock():
    assert compilation_cache.host_fingerprint(AVX512) != compilation_cache.host_fingerprint(AVX2)
    assert compilation_cache.host_fingerprint(AVX512) == compilation_cache.host_fingerprint(
        AVX512.replace("2000", "3100") + AVX512.replace("processor\t: 0", "processor\t: 1"))


def test_the_default_directory_is_under_the_cache_per_host(monkeypatch, tmp_path):
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(tmp_path))
    assert compilation_cache.default_directory() == tmp_path / "xla" / compilation_cache.host_fingerprint()
