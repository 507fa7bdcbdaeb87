"""Hugging Face model ids ("org/name"): loaded from a cache laid out exactly as huggingface_hub
lays it (blobs/<sha>, snapshots/<commit>/<file> symlinks into them, refs/<name> holding a commit
hash), offline, with every connection the Hub client attempts recorded: none may happen unless a
test asks for it."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from tiny_models import save_tiny_model

from zipage_jax import LLM, SamplingParams
from zipage_jax.cli import main
from zipage_jax.commands import serve as serve_command
from zipage_jax.models import hub
from zipage_jax.models.loading import load_model, resolve_source
from zipage_jax.models.param_cache import fingerprint
from zipage_jax.models.weights import flat_params
from zipage_jax.server import create_app

REPO, SHARDED = "org/tiny", "org/tiny-sharded"
UNREACHABLE = ("127.0.0.1", 9)  # the discard port: nothing listens, a connection is refused at once
ENGINE = dict(kvcache_block_size=16, num_kvcache_blocks=32, max_num_seqs=2, max_num_batched_tokens=64,
              max_model_len=128)
PROMPTS = [[5, 9, 14, 3, 7, 11], [8, 1, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def add_snapshot(cache: Path, repo_id: str, model_dir: Path, refs: tuple[str, ...] = ("main",),
                 skip: tuple[str, ...] = ()) -> str:
    """`model_dir`'s files (but `skip`) as a snapshot of `repo_id` in huggingface_hub's cache `cache`,
    named by `refs`; returns its commit hash."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = {f.name: f.read_bytes() for f in sorted(model_dir.iterdir()) if f.is_file() and f.name not in skip}
    shas = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    commit = hashlib.sha1(repr(sorted(shas.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / shas[name]
        if not blob.exists():
            blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / shas[name])
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


def snapshot_path(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_factory) -> types.SimpleNamespace:
    """A hub cache: REPO with main -> commit a (the tiny qwen3 model) and v2 -> commit b (the same
    model with other weights), SHARDED (the tiny qwen2 model, in shards)."""
    cache = tmp_path_factory.mktemp("hf_hub")
    a_dir = tiny_model_factory("qwen3")
    b_dir = save_tiny_model("qwen3", tmp_path_factory.mktemp("tiny_qwen3_seed1"), seed=1)
    sharded_dir = tiny_model_factory("qwen2", sharded=True)
    return types.SimpleNamespace(
        path=cache, a_dir=a_dir, b_dir=b_dir, sharded_dir=sharded_dir,
        a=add_snapshot(cache, REPO, a_dir), b=add_snapshot(cache, REPO, b_dir, refs=("v2",)),
        sharded=add_snapshot(cache, SHARDED, sharded_dir))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path, model_cache_dir):
    """HF_HUB_OFFLINE=1, the Hub's endpoint unreachable, an empty default hub cache, and the
    connections made to the endpoint or off this host: none, unless a test clears them after
    asserting them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    endpoint = "http://{}:{}".format(*UNREACHABLE)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # huggingface_hub read HF_ENDPOINT at import
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "default_hub_cache"))
    monkeypatch.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
    attempts: list = []
    connect = socket.socket.connect

    def recording_connect(sock, address):
        if isinstance(address, tuple) and (address[:2] == UNREACHABLE or address[0] not in ("127.0.0.1", "::1")):
            attempts.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    yield attempts
    assert attempts == [], "the Hub was contacted"


def _tokens(llm: LLM) -> list[list[int]]:
    return [r["token_ids"] for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_model_id_generates_what_its_directory_generates(hub_cache):
    by_path = _tokens(LLM(str(hub_cache.a_dir), **ENGINE))
    llm = LLM(REPO, download_dir=str(hub_cache.path), **ENGINE)
    assert llm.engine.core.loaded.source == str(snapshot_path(hub_cache.path, REPO, hub_cache.a))
    assert _tokens(llm) == by_path
    # where the model came from shapes no program: the directory's, stored, are loaded
    assert {r.origin for r in llm.engine.core.runner.records} == {"loaded"}
    other = LLM(REPO, revision="v2", download_dir=str(hub_cache.path), **ENGINE)
    assert other.engine.core.loaded.source == str(snapshot_path(hub_cache.path, REPO, hub_cache.b))
    assert _tokens(other) != by_path  # other weights, other tokens


def test_a_revision_is_a_ref_or_a_commit_hash(hub_cache, tmp_path):
    cache = str(tmp_path / "params")
    main_ = load_model(REPO, "float32", cache, download_dir=str(hub_cache.path))
    by_commit = load_model(REPO, "float32", cache, revision=hub_cache.b, download_dir=str(hub_cache.path))
    by_ref = load_model(REPO, "float32", cache, revision="v2", download_dir=str(hub_cache.path))
    assert main_.source == str(snapshot_path(hub_cache.path, REPO, hub_cache.a))
    assert by_commit.source == by_ref.source == str(snapshot_path(hub_cache.path, REPO, hub_cache.b))
    # each snapshot is its own parameter cache entry: b converted once, then restored
    assert (main_.from_cache, by_commit.from_cache, by_ref.from_cache) == (False, False, True)
    a_params, b_params = flat_params(main_.model), flat_params(by_ref.model)
    assert main_.config == by_ref.config
    assert not np.array_equal(a_params["norm.weight"], b_params["norm.weight"])
    expected_b = flat_params(load_model(str(hub_cache.b_dir), "float32", cache).model)
    for key, value in b_params.items():
        np.testing.assert_array_equal(value, expected_b[key])


def test_a_sharded_checkpoint_loads_every_shard(hub_cache, tmp_path):
    loaded = load_model(SHARDED, "float32", str(tmp_path), download_dir=str(hub_cache.path))
    snapshot = Path(loaded.source)
    shards = sorted(f.name for f in hub_cache.sharded_dir.glob("model-*.safetensors"))
    assert len(shards) > 1 and (snapshot / "model.safetensors.index.json").is_symlink()
    assert sorted(f.name for f in snapshot.glob("model-*.safetensors")) == shards
    expected = flat_params(load_model(str(hub_cache.sharded_dir), "float32", str(tmp_path)).model)
    got = flat_params(loaded.model)
    assert got.keys() == expected.keys()
    for key, value in got.items():
        np.testing.assert_array_equal(value, expected[key])


def test_a_model_missing_from_the_cache_names_the_id_revision_and_cache(hub_cache):
    with pytest.raises(hub.HubModelError) as missing:
        load_model("org/absent", download_dir=str(hub_cache.path))
    message = str(missing.value)
    assert isinstance(missing.value, FileNotFoundError)
    assert message.startswith(f"Hugging Face model 'org/absent' (revision 'main') is not (completely) in the cache "
                              f"{hub_cache.path} and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to download it")
    assert "--download-dir" in message and "hf auth login" in message
    with pytest.raises(hub.HubModelError, match=f"'{REPO}' \\(revision 'v9'\\) is not \\(completely\\) in the cache"):
        load_model(REPO, revision="v9", download_dir=str(hub_cache.path))


def test_weights_the_snapshot_lacks_are_asked_for_by_name(hub_cache, tmp_path, monkeypatch):
    """The first request asks for config and tokenizer files (and the shard index) only, the second
    for the weight files the snapshot lacks, by its commit hash; nothing else is ever requested."""
    cache = tmp_path / "hub"
    commit = add_snapshot(cache, REPO, hub_cache.a_dir, skip=("model.safetensors",))
    calls = []
    real = hub.snapshot_download

    def recording_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], kwargs["allow_patterns"]))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(hub, "snapshot_download", recording_snapshot_download)
    with pytest.raises(hub.HubModelError, match=f"lacks model.safetensors in {snapshot_path(cache, REPO, commit)}"):
        resolve_source(REPO, download_dir=cache)
    assert calls == [(REPO, None, hub.CONFIG_AND_TOKENIZER_FILES), (REPO, commit, ["model.safetensors"])]

    calls.clear()
    resolve_source(SHARDED, download_dir=hub_cache.path)  # complete: one request
    assert calls == [(SHARDED, None, hub.CONFIG_AND_TOKENIZER_FILES)]

    repo_files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                  "merges.txt", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors", "consolidated.safetensors", "pytorch_model.bin", "README.md",
                  ".gitattributes", "original/tokenizer.model", "onnx/model.onnx"]
    assert list(filter_repo_objects(repo_files, allow_patterns=hub.CONFIG_AND_TOKENIZER_FILES)) == repo_files[:7]
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert list(filter_repo_objects(repo_files, allow_patterns=shards)) == shards


def test_hub_errors_say_what_to_do(monkeypatch, tmp_path):
    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/org/x"))
    for error, expected in [
        (GatedRepoError("gated", response=response), "is gated: accept its conditions on https://huggingface.co/"
                                                     "org/x, then log in with `hf auth login` or set HF_TOKEN"),
        (RepositoryNotFoundError("not found", response=response),
         "is neither a local path nor a model on the Hugging Face Hub (if it is private, log in"),
    ]:
        def failing_snapshot_download(repo_id, error=error, **kwargs):
            raise error

        monkeypatch.setattr(hub, "snapshot_download", failing_snapshot_download)
        with pytest.raises(hub.HubModelError, match=r"^Hugging Face model 'org/x' \(revision 'main'\) ") as info:
            resolve_source("org/x", download_dir=tmp_path)
        assert expected in str(info.value) and info.value.__cause__ is error


def test_an_unreachable_hub_falls_back_to_the_cache(hub_cache, offline, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert resolve_source(REPO, download_dir=hub_cache.path) == snapshot_path(hub_cache.path, REPO, hub_cache.a)
    with pytest.raises(hub.HubModelError, match="and the Hugging Face Hub could not be reached: download it with"):
        resolve_source("org/absent", download_dir=hub_cache.path)
    assert offline and set(offline) == {UNREACHABLE}  # it asked the Hub, which did not answer
    offline.clear()


def test_the_default_cache_follows_the_environment(hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache.path))
    assert resolve_source(REPO) == snapshot_path(hub_cache.path, REPO, hub_cache.a)
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf_home"
    home.mkdir()
    (home / "hub").symlink_to(hub_cache.path)
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub.default_download_dir() == home / "hub"
    assert resolve_source(REPO, revision="v2") == snapshot_path(hub_cache.path, REPO, hub_cache.b)
    monkeypatch.delenv("HF_HOME")
    assert hub.default_download_dir() == Path(constants.HF_HUB_CACHE)  # what huggingface_hub chose at import


def test_paths_registry_names_and_ids_are_told_apart(hub_cache, tmp_path, monkeypatch):
    assert [m for m in ["org/name", "Qwen/Qwen3-0.6B", "a/b/c", "/abs/x", "./org/x", "~/org", "org/x.gguf",
                        "org/x--y", "default", "name"] if hub.is_repo_id(m)] == ["org/name", "Qwen/Qwen3-0.6B"]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hub_cache.a_dir, tmp_path / "org" / "tiny")
    assert resolve_source(REPO, download_dir=hub_cache.path) == Path(REPO)  # an existing path stays a path
    for path in ["a/b/c", "./org/x", str(tmp_path / "none"), "org/x.gguf"]:
        with pytest.raises(FileNotFoundError, match=f"model path '{path}' does not exist$"):
            resolve_source(path)
    for model in ["default", REPO, str(tmp_path / "org" / "tiny")]:
        with pytest.raises(ValueError, match=f"revision 'v2' applies to Hugging Face model ids .* not to '{model}'"):
            resolve_source(model, revision="v2")


def test_a_snapshot_fingerprints_its_blobs(hub_cache, tmp_path):
    cache = tmp_path / "hub"
    commit = add_snapshot(cache, REPO, hub_cache.a_dir)
    files = sorted(snapshot_path(cache, REPO, commit).iterdir())
    key = fingerprint(files, "float32")
    config = files[[f.name for f in files].index("config.json")]
    os.utime(config.resolve(), ns=(1, 1))  # the blob, not the link
    assert fingerprint(files, "float32") != key
    other = sorted(snapshot_path(hub_cache.path, REPO, hub_cache.b).iterdir())
    assert fingerprint(other, "float32") not in (key, fingerprint(files, "float32"))


def test_generate_takes_revision_and_download_dir(hub_cache, monkeypatch):
    reached = []

    def stop_at_load(model, dtype=None, cache_dir=None, *, revision=None, download_dir=None):
        reached.append(resolve_source(model, cache_dir, revision=revision, download_dir=download_dir))
        raise ValueError("reached load_model")

    monkeypatch.setattr("zipage_jax.engine.core.load_model", stop_at_load)
    assert main(["generate", "hi", "--model", REPO, "--revision", "v2", "--download-dir", str(hub_cache.path),
                 "--kvcache-block-size", "16"]) == 2
    assert reached == [snapshot_path(hub_cache.path, REPO, hub_cache.b)]


@pytest.mark.slow
def test_serve_names_the_model_by_its_id(hub_cache, monkeypatch):
    """`serve --model ID` (its engine core in a process of its own) names the model ID and serves
    the snapshot its default revision points at: the texts it generates are snapshot a's."""
    made = []

    def recording_create_app(client, names, *args, **kwargs):
        made.append(create_app(client, names, *args, **kwargs))
        return made[-1]

    with monkeypatch.context() as mp:
        mp.setattr(serve_command, "create_app", recording_create_app)
        mp.setattr(uvicorn.Server, "run", lambda self, *args, **kwargs: None)
        assert main(["serve", "--model", REPO, "--download-dir", str(hub_cache.path), "--no-warmup",
                     *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]]) == 0
    (app,) = made
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while (health := client.get("/health")).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 200, health.text
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [REPO]
        reply = client.post("/v1/completions", json={"model": REPO, "prompt": PROMPTS, "temperature": 0,
                                                      "max_tokens": GREEDY.max_tokens, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["model"] == REPO
    assert app.state.engine_client.config.model == REPO
    served = [choice["text"] for choice in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    texts = {name: [r["text"] for r in LLM(str(model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
             for name, model_dir in (("a", hub_cache.a_dir), ("b", hub_cache.b_dir))}
    assert texts["a"] != texts["b"]  # the check tells the snapshots apart
    assert served == texts["a"]

