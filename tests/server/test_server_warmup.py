"""The server warms up: with warm-up on (`zipage-jax serve`'s default) the loaded engine builds its
compiled programs in the background, and /health, generation and tokenizer routes answer 503
until the serving set (the largest program of each kind) is built; /metrics counts the programs
and the seconds spent building them; stopping the server stops the warm-up. With warm-up off the
server is ready once the model has loaded, and programs compile when requests need them.

The real engine core on the tiny model (driven in this process), with options that keep its grid
small. The window before the serving set is ready is held open by a Gate (the grid's builds wait
for the test), not by timing."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import threading
import types
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from server_harness import CHAT, COMPLETIONS, MODEL, ROOT, USER, ServerThread, parse_metrics, serve, wait_for

from zipage_jax.commands import serve as serve_command
from zipage_jax.config import EngineConfig
from zipage_jax.engine.core import EngineCore
from zipage_jax.engine.runner import warmup as warmup_module
from zipage_jax.engine.runner.model_runner import ModelRunner
from zipage_jax.server import create_app
from zipage_jax.server.engine_client import InProcessEngineClient

OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128, max_compress_seqs=2)
WARMING = re.compile(r"the server is warming up: (\d+) of (\d+) programs ready; "
                     r"it serves once the largest program of each kind is")
GATE_TIMEOUT_S = 120  # a gate the test never opens fails its builds rather than hanging the suite
LOAD_TIMEOUT_S = 120
WARMUP_TIMEOUT_S = 300  # the whole grid, on a loaded CPU


class Gate:
    """The warm-up's builds (the serving set's, or with `everything` all of them) wait until the
    test opens the gate; `arrived` counts the builds that reached it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, everything: bool = False):
        self.opened = threading.Event()
        self.arrived = 0
        self._lock = threading.Lock()
        step_grid = ModelRunner.step_grid

        def gated_grid(runner: ModelRunner) -> list:
            return [dataclasses.replace(p, build=self._held(p.build)) if everything or p.serving else p
                    for p in step_grid(runner)]

        monkeypatch.setattr(ModelRunner, "step_grid", gated_grid)

    def _held(self, build):
        def held() -> None:
            with self._lock:
                self.arrived += 1
            if not self.opened.wait(GATE_TIMEOUT_S):
                raise TimeoutError("the test never opened the gate")
            build()

        return held


@contextlib.contextmanager
def serving(tiny_model_factory, model_cache_dir, store, *, warmup: bool, gate: Gate | None = None) -> Iterator:
    """A ServerThread over the real engine core (executables stored in `store`), its model loaded,
    with .app, .engine (the core) and .http; the gate is opened before the server stops (which waits for
    the builds in progress)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        model_dir = str(tiny_model_factory("qwen3"))
        client = InProcessEngineClient(lambda: EngineCore(model=model_dir, compilation_cache_dir=str(store), **OPTIONS))
        app = create_app(client, [MODEL], warmup=warmup)
        srv = ServerThread(app)
        try:
            assert client.ready.wait(LOAD_TIMEOUT_S), "the model did not load"
            srv.engine = client.core
            srv.http = httpx.Client(base_url=srv.url, timeout=120)
            yield srv
        finally:
            if gate is not None:
                gate.opened.set()
            srv.close()
            assert not srv.thread.is_alive(), "the server did not stop"


def metrics(srv) -> dict[str, float]:
    return parse_metrics(srv.http.get("/metrics").text)


def built(srv) -> int:
    """The programs the engine has built, as it counts them now (the server idle)."""
    return srv.engine.get_stats().num_compiles


def complete(srv, max_tokens: int = 4) -> httpx.Response:
    return srv.http.post(COMPLETIONS, json=dict(model=MODEL, prompt="warm hello", max_tokens=max_tokens,
                                                temperature=0, ignore_eos=True))


def test_not_ready_until_the_serving_set_is_built(tiny_model_factory, model_cache_dir, tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    store = tmp_path / "executables"
    with serving(tiny_model_factory, model_cache_dir, store, warmup=True, gate=gate) as srv:
        grid = srv.engine.runner.step_grid()
        total, num_serving = len(grid), sum(p.serving for p in grid)
        assert 0 < num_serving < total
        wait_for(lambda: metrics(srv)["zipage:warmup_programs_total"] > 0, 30, "the warm-up did not start")

        r = srv.http.get("/health")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("service_unavailable", "warming_up", None)
        match = WARMING.fullmatch(error["message"])
        assert match, error["message"]
        ready, of = map(int, match.groups())
        assert of == total and ready <= total - num_serving  # the serving set waits at the gate

        for path, body in ((COMPLETIONS, dict(model=MODEL, prompt="too early", max_tokens=2)),
                           (CHAT, dict(model=MODEL, messages=USER, max_tokens=2)),
                           ("/tokenize", dict(model=MODEL, prompt="too early"))):
            r = srv.http.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up", (path, r.text)

        m = metrics(srv)
        assert m["zipage:warmup_programs_total"] == total
        assert m["zipage:warmup_programs_ready"] <= total - num_serving
        assert m["zipage:warmup_serving_ready"] == 0 and m["zipage:warmup_done"] == 0
        assert m["vllm:prompt_tokens_total"] == 0  # nothing reached the engine

        gate.opened.set()
        wait_for(lambda: srv.http.get("/health").status_code == 200, WARMUP_TIMEOUT_S,
                 "the server did not become ready")
        assert srv.http.get("/health").json() == {"status": "ok"}
        assert metrics(srv)["zipage:warmup_serving_ready"] == 1
        r = complete(srv)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        r = srv.http.post("/tokenize", json=dict(model=MODEL, prompt="now"))
        assert r.status_code == 200 and r.json()["count"] > 0

        # the rest of the grid builds behind the serving set; the stats snapshot follows it
        wait_for(lambda: (m := metrics(srv))["zipage:warmup_done"] == 1
                 and m["zipage:programs_ready"] == built(srv), WARMUP_TIMEOUT_S,
                 "the warm-up did not finish")
        m = metrics(srv)
        assert m["zipage:warmup_programs_ready"] == m["zipage:warmup_programs_total"] == total
        assert m["zipage:warmup_programs_failed"] == 0
        assert m["zipage:programs_ready"] >= total  # a forward step of the grid is built as several programs
        assert m["zipage:compile_seconds_total"] > 0
        assert m["zipage:programs_loaded_total"] == 0  # a fresh store: everything was compiled
        compiled = m["zipage:programs_ready"]
        assert complete(srv).status_code == 200
        assert metrics(srv)["zipage:programs_ready"] == compiled  # nothing compiles after the warm-up

    # a restart loads the grid from the store instead of compiling it
    with serving(tiny_model_factory, model_cache_dir, store, warmup=True) as srv:
        wait_for(lambda: (m := metrics(srv))["zipage:warmup_done"] == 1
                 and m["zipage:programs_ready"] == built(srv), WARMUP_TIMEOUT_S,
                 "the restarted warm-up did not finish")
        assert srv.http.get("/health").status_code == 200
        m = metrics(srv)
        assert m["zipage:warmup_programs_ready"] == total and m["zipage:programs_ready"] == compiled
        assert m["zipage:programs_loaded_total"] == compiled
        assert m["zipage:compile_seconds_total"] > 0  # loading takes time too


def test_not_ready_before_the_warm_up_reports(tiny_model_factory, model_cache_dir, tmp_path, monkeypatch):
    """Between the model loading and the core's first warm-up status the server is not ready
    either: a client that sees /health 200 can send at once."""
    held, entered = threading.Event(), threading.Event()
    start_warmup = EngineCore.start_warmup

    def held_start(core: EngineCore):
        entered.set()
        assert held.wait(GATE_TIMEOUT_S), "the test never let the warm-up start"
        return start_warmup(core)

    monkeypatch.setattr(EngineCore, "start_warmup", held_start)
    with serving(tiny_model_factory, model_cache_dir, tmp_path / "executables", warmup=True) as srv:
        try:
            assert entered.wait(30), "the warm-up was never started"
            r = srv.http.get("/health")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "warming_up"
            assert "the server is warming up: it is starting;" in r.json()["error"]["message"]
            r = complete(srv)
            assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up", r.text
            assert metrics(srv)["zipage:warmup_serving_ready"] == 0
        finally:
            held.set()
        wait_for(lambda: srv.http.get("/health").status_code == 200, WARMUP_TIMEOUT_S,
                 "the server did not become ready")
        assert complete(srv).status_code == 200


def test_without_warmup_the_server_is_ready_once_loaded(tiny_model_factory, model_cache_dir, tmp_path):
    with serving(tiny_model_factory, model_cache_dir, tmp_path / "executables", warmup=False) as srv:
        r = srv.http.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert srv.engine.warmup_status is None
        m = metrics(srv)
        for name in ("zipage:warmup_programs_total", "zipage:warmup_programs_ready", "zipage:warmup_serving_ready",
                     "zipage:warmup_done", "zipage:programs_ready", "zipage:compile_seconds_total",
                     "zipage:programs_loaded_total"):
            assert m[name] == 0, name
        r = complete(srv, max_tokens=2)
        assert r.status_code == 200, r.text
        m = metrics(srv)  # the programs the request needed were compiled for it
        assert m["zipage:programs_ready"] > 0 and m["zipage:compile_seconds_total"] > 0
        assert m["zipage:programs_loaded_total"] == 0 and m["zipage:warmup_programs_total"] == 0


def test_stopping_the_server_stops_the_warm_up(tiny_model_factory, model_cache_dir, tmp_path, monkeypatch):
    gate = Gate(monkeypatch, everything=True)
    stopping = threading.Event()
    stop = warmup_module.Warmup.stop

    def recorded_stop(self) -> None:
        stopping.set()
        stop(self)

    monkeypatch.setattr(warmup_module.Warmup, "stop", recorded_stop)
    before = set(threading.enumerate())
    with serving(tiny_model_factory, model_cache_dir, tmp_path / "executables", warmup=True, gate=gate) as srv:
        engine = srv.engine
        total = engine.warmup_status.total
        in_flight = min(warmup_module.default_workers(), total)
        assert in_flight < total
        wait_for(lambda: gate.arrived == in_flight, 30, "the warm-up's workers did not start")
        closer = threading.Thread(target=srv.close, daemon=True)
        closer.start()
        assert stopping.wait(30), "stopping the server did not stop the warm-up"
        gate.opened.set()  # the builds in progress finish; no other starts
        closer.join(60)
        assert not closer.is_alive()
    status = engine.warmup_status
    assert status.done and status.ready == in_flight and status.failed == 0
    assert gate.arrived == in_flight < total  # no build started after the stop
    started = set(threading.enumerate()) - before
    assert [t.name for t in started if t.name.startswith(("zipage-warmup", "zipage-engine"))] == []


# -- zipage-jax serve --------------------------------------------------------------------------------


@pytest.fixture
def serve_run(monkeypatch):
    """Runs `zipage-jax serve` without a model or a port: what it passes create_app, and the
    configuration its engine core (in a process of its own) is started with."""
    calls: list[dict] = []
    clients: list[types.SimpleNamespace] = []

    def fake_client(config, log_level):
        clients.append(types.SimpleNamespace(config=config, log_level=log_level, load_error=None, engine_error=None))
        return clients[-1]

    def fake_create_app(client, names, *args, **kwargs):
        calls.append(dict(kwargs, client=client))
        serving = types.SimpleNamespace(stop_admitting=None, abort_in_flight=None)
        return types.SimpleNamespace(state=types.SimpleNamespace(engine_client=client, serving=serving))

    monkeypatch.setattr(serve_command, "create_app", fake_create_app)
    monkeypatch.setattr(serve_command, "MultiProcessEngineClient", fake_client)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *args, **kwargs: None)

    def run(*argv: str) -> tuple[bool, EngineConfig]:
        calls.clear()
        clients.clear()
        assert serve("--kvcache-block-size", "16", *argv) == 0
        assert len(calls) == 1 and len(clients) == 1 and calls[0]["client"] is clients[0]
        return calls[0]["warmup"], clients[0].config

    return run


@pytest.mark.parametrize("argv, warmup", [((), True), (("--warmup",), True), (("--no-warmup",), False)])
def test_serve_warms_up_in_the_background_unless_told_not_to(serve_run, argv, warmup):
    app_warmup, engine_config = serve_run(*argv)
    assert app_warmup is warmup
    assert engine_config.warmup is False  # never the engine's blocking warm-up
    assert engine_config.kvcache_block_size == 16 and engine_config.model == "default"


def test_the_launcher_scripts_help_says_the_server_warms_up_by_default():
    """scripts/serve_jax.py launches `zipage-jax serve`."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_jax.py"), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert text.startswith("usage: zipage-jax serve")
    help_text = text.split("--warmup, --no-warmup ", 1)[1][:400]
    assert help_text.startswith("build every compiled program in the background")
    assert "(default: on; --no-warmup: serve at once, compiling programs when the first requests need them)" \
        in help_text
