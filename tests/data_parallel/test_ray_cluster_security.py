"""The local Ray that RayCluster starts: every Ray process listens on loopback alone, and the
GCS refuses a client without the cluster's token (or with another one) while it serves one with
it; replicas serve on it; each cluster gets a token of its own, and stop() puts the environment
back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest
from listeners import is_loopback, tcp_listeners
from replicated_harness import replicated_server
from server_harness import COMPLETIONS, MODEL

ray = pytest.importorskip("ray")
from zipage_jax.data_parallel.ray_cluster import RayCluster  # noqa: E402

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")
REFUSED = "Authentication token is missing or incorrect"
CLIENT_TIMEOUT_S = 60  # a Python importing Ray and making one call: a few seconds


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another Ray of this process would be used as it is"
    started = RayCluster.start(num_cpus=2)
    yield started
    started.stop()


@ray.remote
class Probe:
    def pid(self) -> int:
        return os.getpid()


@ray.remote
def task_pid() -> int:
    return os.getpid()


def this_process_and_descendants() -> list[psutil.Process]:
    """This process (the driver) and what it started: Ray's processes, and the workers the raylet started."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def test_each_cluster_has_a_token_of_its_own_and_stop_puts_the_environment_back(monkeypatch):
    """ray.init stands in for Ray: what it finds in the environment of two clusters, one after the other
    (before the module's cluster starts: this changes what Ray in this process reads)."""
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the user's")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append((kw, {k: os.environ.get(k) for k in AUTH_ENV})))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    for _ in range(2):
        RayCluster.start(num_cpus=3).stop()
        assert os.environ.get("RAY_AUTH_TOKEN") == "the user's" and "RAY_AUTH_MODE" not in os.environ
    (kw, first), (_, second) = seen
    assert kw == {"num_cpus": 3, "include_dashboard": False}
    assert first["RAY_AUTH_MODE"] == second["RAY_AUTH_MODE"] == "token"
    assert len({first["RAY_AUTH_TOKEN"], second["RAY_AUTH_TOKEN"], "the user's"}) == 3
    assert len(first["RAY_AUTH_TOKEN"]) == 64


def test_a_cluster_in_ray_address_is_joined_as_it_is(monkeypatch):
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, os.environ.get("RAY_AUTH_TOKEN"))))
    cluster = RayCluster.start(num_cpus=3)
    assert calls == [({"address": "10.0.0.7:6379"}, None)] and not cluster.owned


def test_every_ray_process_listens_on_loopback_alone(cluster):
    assert cluster.owned
    actor = Probe.remote()
    worker_pids = {ray.get(actor.pid.remote()), ray.get(task_pid.remote())}
    listeners = tcp_listeners(this_process_and_descendants())
    beyond = [entry for entry in listeners if not is_loopback(entry[2])]
    assert beyond == [], beyond
    names = {name for _, name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names, names  # the check saw Ray's servers...
    assert worker_pids <= {pid for pid, _, _, _ in listeners}, (worker_pids, listeners)  # ...and its workers
    ray.kill(actor)


def test_the_listener_check_finds_a_socket_on_every_interface():
    """Positive control: the same functions report a listener bound beyond loopback."""
    with socket.create_server(("0.0.0.0", 0)) as server:
        port = server.getsockname()[1]
        mine = [entry for entry in tcp_listeners(this_process_and_descendants()) if entry[3] == port]
    assert mine == [(os.getpid(), psutil.Process().name(), "0.0.0.0", port)]
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and is_loopback("::ffff:127.0.0.1")


def test_the_gcs_refuses_a_client_without_the_clusters_token(cluster, tmp_path):
    address = ray.get_runtime_context().gcs_address
    call = f"from ray._raylet import GcsClient; print('nodes', len(GcsClient(address={address!r}).get_all_node_info()))"
    # a HOME of its own: no ~/.ray/auth_token either
    no_token = {k: v for k, v in os.environ.items() if k not in AUTH_ENV} | {"HOME": str(tmp_path)}
    clients = {"without a token": no_token,
               "with another token": no_token | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
               "with the cluster's token": dict(os.environ)}
    running = {name: subprocess.Popen([sys.executable, "-c", call], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for name, env in clients.items()}
    ended = {name: (proc.communicate(timeout=CLIENT_TIMEOUT_S)[0], proc.returncode) for name, proc in running.items()}
    for name in ("without a token", "with another token"):
        out, code = ended[name]
        assert code != 0 and "AuthenticationError" in out and REFUSED in out, (name, out)
    out, code = ended["with the cluster's token"]  # positive control: the same call, the token given
    assert code == 0 and "nodes 1" in out, out


@pytest.mark.slow  # two replicas load the model: about a minute
def test_replicas_serve_on_the_local_cluster_and_listen_on_loopback(cluster, tiny_model_factory, model_cache_dir):
    with replicated_server(tiny_model_factory, model_cache_dir, data_parallel_size=2) as srv:
        body = dict(model=MODEL, prompt=[5, 40, 77, 90], max_tokens=4, temperature=0, ignore_eos=True)
        served = [srv.http.post(COMPLETIONS, json=body) for _ in range(4)]
        assert [r.status_code for r in served] == [200] * 4, served[0].text
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in served)
        listeners = tcp_listeners(this_process_and_descendants())
    assert [entry for entry in listeners if not is_loopback(entry[2])] == []
    replicas = {pid for pid, name, _, _ in listeners if name.startswith("ray::EngineReplica")}
    assert len(replicas) == 2, listeners  # the check saw the replicas' own servers
