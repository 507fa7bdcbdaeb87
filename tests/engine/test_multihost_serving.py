"""`zipage-jax serve` over two processes (tensor parallelism across them, gloo collectives on
CPU): process 0 serves and schedules, process 1 replays its runner's device calls
(engine/runner/step_relay.py).

The relay's handshake, framing, heartbeat, follower loop and fault handling run in this process
on fake runners, against fuzzed connections and fake peers; the served pair runs as real
subprocesses, one CPU device each, and its greedy tokens must equal one process's (full KV, and
compressed under a small kv_budget), streamed or not. A follower killed mid-request makes
process 0 fail the requests in flight and exit with status 1; a killed process 0 ends its
follower.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import hmac
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from listeners import is_loopback, process_tree, tcp_listeners
from relay_calls import assert_same_arguments, relayed_calls

from zipage_jax.engine.runner import relay_auth, step_relay
from zipage_jax.engine.runner.relay_auth import (
    SECRET_ENV,
    RelayAuthError,
    prove_follower,
    read_greeting,
    relay_secret,
)
from zipage_jax.engine.runner.relay_wire import (
    HEADER_SIZE,
    Beat,
    Call,
    CheckIn,
    Failed,
    RelayProtocolError,
    Stop,
    decode,
    frame,
    read_message,
)
from zipage_jax.engine.runner.step_relay import (
    EXIT_STATUS,
    Follower,
    LeaderRelay,
    PeerLost,
    relay_address,
    runner_signature,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 8, 11, 64, 65, 66, 3, 9, 1, 2, 77, 31, 33, 12], [300, 1, 2, 3], [7] * 37,
           [200, 201]]
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
               dtype="float32", compilation_cache_dir="")
FULL_TOKENS, COMPRESSED_TOKENS, KV_BUDGET = 24, 60, 32
STARTUP_S = 600  # two processes loading and (with a warm-up) compiling on a small CI machine
EXIT_BOUND_S = 60  # how soon a broken group must have exited
SECRET = b"the group's secret, 32 bytes ok"
WRONG_SECRET = b"another group's secret, not ours"
RELAY_MODULES = ["step_relay.py", "relay_wire.py", "relay_auth.py"]


# -- the relay in this process, on fake runners -------------------------------------------------


@dataclass
class FakeConfig:
    tensor_parallel_size: int = 2
    max_num_seqs: int = 8


class FakeRunner:
    """What the relay reads of a runner (config, pool, model config), recording the calls it gets."""

    def __init__(self, config: FakeConfig | None = None, fail: str | None = None):
        self.config, self.pool, self.model_config = config or FakeConfig(), "pool(64 blocks)", "model(2 layers)"
        self.relay = None
        self.calls: list[tuple] = []
        self._fail = fail

    def _record(self, name, *args):
        if name == self._fail:
            raise RuntimeError("boom")
        self.calls.append((name, args))

    def run_forward(self, key, inputs, sampling, prompt_targets):
        self._record("run_forward", key, inputs, sampling, prompt_targets)

    def run_compaction(self, key, tables):
        self._record("run_compaction", key, tables)

    def run_seed(self, key, slot, tokens, num_prompt):
        self._record("run_seed", key, slot, tokens, num_prompt)

    def reset_state(self):
        self._record("reset_state")

    def prefetch_decode(self, num_rows):
        self._record("prefetch_decode", num_rows)


class Lost:
    """on_lost and hard_exit of a LeaderRelay under test."""

    def __init__(self):
        self.reasons: list[str] = []
        self.exits: list[int] = []
        self.exited = threading.Event()

    def on_lost(self, reason: str) -> None:
        self.reasons.append(reason)

    def hard_exit(self, status: int) -> None:
        self.exits.append(status)
        self.exited.set()


def _leader(lost: Lost, num_followers: int = 1, **timeouts) -> LeaderRelay:
    return LeaderRelay("127.0.0.1", 0, num_followers, lost.on_lost, secret=SECRET, exit_grace_s=0.05,
                       hard_exit=lost.hard_exit, **timeouts)


def _follow_in_thread(runner: FakeRunner, relay: LeaderRelay, process_id: int = 1, secret: bytes = SECRET,
                      **options) -> dict:
    result: dict = {}

    def run() -> None:
        follower = Follower(runner, relay.address, process_id, secret=secret, **options)
        try:
            result["status"] = follower.run(follower.connect(timeout_s=10))
        except Exception as exc:  # noqa: BLE001 - asserted by the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def _checked_in(relay: LeaderRelay, process_id: int = 1, secret: bytes = SECRET) -> socket.socket:
    """A hand-made follower: the handshake and a check-in, then nothing (no heartbeat)."""
    sock = socket.create_connection(relay.address, timeout=10)
    deadline = time.monotonic() + 10
    prove_follower(sock, secret, read_greeting(sock, deadline), deadline)
    sock.sendall(frame(CheckIn(process_id, runner_signature(FakeRunner()))))
    return sock


def test_relay_address_is_the_coordinators_host_and_next_port_unless_given():
    assert relay_address("10.1.2.3:1234") == ("10.1.2.3", 1235)
    assert relay_address("[::1]:1234", 4000) == ("::1", 4000)
    assert relay_address("node-0:8476") == ("node-0", 8477)
    for bad in ("1234", "host:", ":1234"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            relay_address(bad)
    with pytest.raises(ValueError, match="--coordinator-address"):
        relay_address(None)
    with pytest.raises(ValueError, match="relay port"):
        relay_address("host:65535")


def test_follower_replays_every_call_in_order_then_stops_cleanly():
    lost = Lost()
    relay, leader, follower = _leader(lost), FakeRunner(), FakeRunner()
    followed = _follow_in_thread(follower, relay)
    relay.attach(leader, timeout_s=10)
    assert leader.relay is relay
    for method, args in relayed_calls():
        relay.publish(method, args)
    relay.close()
    followed["thread"].join(10)
    assert followed["status"] == 0 and not lost.reasons and not lost.exits
    assert [name for name, _ in follower.calls] == [method for method, _ in relayed_calls()]
    for (_, got), (_, expected) in zip(follower.calls, relayed_calls(), strict=True):
        assert_same_arguments(got, expected)


def test_a_lost_follower_fails_publish_calls_on_lost_and_exits_after_the_grace():
    lost = Lost()
    relay = _leader(lost)
    sock = _checked_in(relay)
    relay.attach(FakeRunner(), timeout_s=10)
    sock.close()  # the follower dies
    assert lost.exited.wait(10)
    assert lost.exits == [EXIT_STATUS] == [1]
    assert len(lost.reasons) == 1 and "process 1" in lost.reasons[0] and "closed" in lost.reasons[0]
    with pytest.raises(PeerLost, match="process 1"):
        relay.publish("reset_state", ())


def test_a_follower_whose_call_fails_says_why_and_exits_non_zero():
    lost = Lost()
    relay = _leader(lost)
    followed = _follow_in_thread(FakeRunner(fail="reset_state"), relay)
    relay.attach(FakeRunner(), timeout_s=10)
    relay.publish("reset_state", ())
    followed["thread"].join(10)
    assert followed["status"] == EXIT_STATUS
    assert lost.exited.wait(10)
    assert lost.reasons == ["process 1 failed: reset_state: RuntimeError: boom"]


def test_process_0_publishes_only_relayed_calls_of_their_schema():
    relay = _leader(Lost())
    with pytest.raises(RelayProtocolError, match="'__init__' is not a relayed runner call"):
        relay.publish("__init__", ())
    with pytest.raises(RelayProtocolError, match="takes 1 arguments"):
        relay.publish("prefetch_decode", ())
    relay.close()


def test_a_follower_with_other_options_is_refused_by_name():
    lost = Lost()
    relay = _leader(lost)
    followed = _follow_in_thread(FakeRunner(FakeConfig(max_num_seqs=16)), relay)
    with pytest.raises(ValueError, match=r"process 1 built a different engine than process 0 \(max_num_seqs differ\)"):
        relay.attach(FakeRunner(), timeout_s=10)
    followed["thread"].join(10)
    assert followed["status"] == EXIT_STATUS  # its connection closed


def test_a_process_id_that_is_not_awaited_is_refused():
    relay = _leader(Lost())
    sock = _checked_in(relay, process_id=3)
    with pytest.raises(ValueError, match=r"process 3 connected to the relay, which waits for process\(es\) 1"):
        relay.attach(FakeRunner(), timeout_s=10)
    sock.close()


def test_process_0_waits_for_its_followers_a_bounded_time():
    relay = _leader(Lost(), num_followers=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"process\(es\) 1, 2 did not connect to the relay at 127\.0\.0\.1:\d+"):
        relay.attach(FakeRunner(), timeout_s=0.3)
    assert time.monotonic() - started < 5


# -- bad peers: the handshake, fuzzed connections, fake process 0s ------------------------------


class _Exploit:
    """Unpickled, it creates `marker`: what loading a pickle from the relay port would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def _attackers(address: tuple[str, int], marker: Path) -> dict[str, object]:
    """Connections that must all be dropped: name -> what it does once connected."""
    exploit = pickle.dumps(_Exploit(marker))

    def authenticated(then: bytes):  # holds the secret, then sends what is no check-in
        def attack(sock: socket.socket) -> None:
            deadline = time.monotonic() + 10
            prove_follower(sock, SECRET, read_greeting(sock, deadline), deadline)
            sock.sendall(then)
        return attack

    def wrong_hmac(sock: socket.socket) -> None:
        nonce = read_greeting(sock, time.monotonic() + 10)
        sock.sendall(nonce + hmac.new(WRONG_SECRET, relay_auth.FOLLOWER_LABEL + nonce + nonce,
                                      hashlib.sha256).digest())

    return {
        "no secret, a pickle": lambda sock: sock.sendall(len(exploit).to_bytes(8, "big") + exploit),
        "no secret, a check-in": lambda sock: sock.sendall(frame(CheckIn(1, runner_signature(FakeRunner())))),
        "wrong hmac": wrong_hmac,
        "garbage": lambda sock: sock.sendall(np.random.default_rng(0).bytes(4096)),
        "truncated proof": lambda sock: sock.sendall(read_greeting(sock, time.monotonic() + 10)[:7]),
        "huge length": lambda sock: sock.sendall(b"\xff" * 64),
        "silent": lambda sock: None,
        "closes at once": lambda sock: sock.close(),
        "secret, then a huge length": authenticated(b"\xff\xff\xff\xff"),
        "secret, then a pickle": authenticated(len(exploit).to_bytes(HEADER_SIZE, "big") + exploit),
        "secret, then an unknown method": authenticated(
            len(p := msgpack.packb({"type": "call", "method": "__init__", "args": []})).to_bytes(HEADER_SIZE, "big")
            + p),
        "secret, then a truncated check-in": authenticated(frame(CheckIn(1, {}))[:-2]),
        "secret, then a beat": authenticated(frame(Beat())),
    }


def test_fuzzed_connections_are_dropped_and_the_real_follower_still_joins(tmp_path, caplog):
    marker = tmp_path / "pwned"
    lost, leader, follower = Lost(), FakeRunner(), FakeRunner()
    relay = _leader(lost, handshake_timeout_s=1.0)
    attackers = _attackers(relay.address, marker)
    held = []
    with caplog.at_level(logging.WARNING, logger="zipage_jax"):
        for attack in attackers.values():
            sock = socket.create_connection(relay.address, timeout=10)
            held.append(sock)
            try:
                attack(sock)
            except OSError:
                pass  # process 0 dropped it first
        followed = _follow_in_thread(follower, relay)  # the real one, with the silent ones still open
        relay.attach(leader, timeout_s=10)
        relay.publish(*relayed_calls()[0])
        relay.close()
        followed["thread"].join(10)
        deadline = time.monotonic() + 10
        while len(_drops(caplog)) < len(attackers) and time.monotonic() < deadline:
            time.sleep(0.05)
    for sock in held:
        sock.close()
    assert followed["status"] == 0 and not lost.reasons
    assert [name for name, _ in follower.calls] == ["run_forward"]
    assert_same_arguments(follower.calls[0][1], relayed_calls()[0][1])
    drops = _drops(caplog)
    assert len(drops) == len(attackers), drops
    assert sum("did not prove it holds the group's relay secret" in d for d in drops) >= 2  # the wrong proofs
    assert any("not a check-in" in d for d in drops) and any("over the limit" in d for d in drops)
    assert any("not a relayed runner call" in d for d in drops) and any("in time" in d for d in drops)
    assert any("not a msgpack message" in d for d in drops)
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Exploit(marker)))  # control: the pickle sent would have run code
    assert marker.exists()


def _drops(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "relay: dropped a connection" in r.getMessage()]


def test_a_follower_with_the_wrong_secret_is_refused_and_the_right_one_joins():
    lost = Lost()
    relay = _leader(lost)
    impostor = _follow_in_thread(FakeRunner(), relay, secret=WRONG_SECRET)
    impostor["thread"].join(10)
    assert isinstance(impostor.get("error"), RelayAuthError), impostor
    assert "same relay secret" in str(impostor["error"]) and SECRET_ENV in str(impostor["error"])
    follower = FakeRunner()
    followed = _follow_in_thread(follower, relay)  # control: the same follower with the group's secret
    relay.attach(FakeRunner(), timeout_s=10)
    relay.publish("reset_state", ())
    relay.close()
    followed["thread"].join(10)
    assert followed["status"] == 0 and follower.calls == [("reset_state", ())]


def test_a_flood_of_silent_connections_delays_the_real_follower_at_most_a_handshake_timeout(caplog):
    lost, follower = Lost(), FakeRunner()
    relay = _leader(lost, handshake_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="zipage_jax"):
        flood = [socket.create_connection(relay.address, timeout=10) for _ in range(step_relay.MAX_HANDSHAKES + 8)]
        followed = _follow_in_thread(follower, relay)  # refused while the flood fills the handshakes: it tries again
        relay.attach(FakeRunner(), timeout_s=10)
    assert any(f"{step_relay.MAX_HANDSHAKES} others are in their handshake" in r.getMessage() for r in caplog.records)
    relay.publish("prefetch_decode", (4,))
    relay.close()
    followed["thread"].join(10)
    assert followed["status"] == 0 and follower.calls == [("prefetch_decode", (4,))]
    for sock in flood:
        sock.close()


class FakeProcess0:
    """A relay port that answers the handshake with `secret`'s proof, checks nothing, records the
    follower's first message after it, and then sends `frames`."""

    def __init__(self, secret: bytes, frames: list[bytes]):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self.first: object = None
        self.last: object = None
        self._secret, self._frames = secret, frames
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self._listener.accept()
        with sock, self._listener:
            nonce0 = os.urandom(relay_auth.NONCE_SIZE)
            sock.sendall(relay_auth.MAGIC + nonce0)
            answer = sock.recv(relay_auth.NONCE_SIZE + relay_auth.DIGEST_SIZE, socket.MSG_WAITALL)
            nonce1 = answer[:relay_auth.NONCE_SIZE]
            sock.sendall(hmac.new(self._secret, relay_auth.LEADER_LABEL + nonce0 + nonce1, hashlib.sha256).digest())
            try:
                self.first = read_message(sock, time.monotonic() + 10)
                for data in self._frames:
                    sock.sendall(data)
                self.last = read_message(sock, time.monotonic() + 10)  # what the follower says last
            except (OSError, EOFError) as exc:
                self.first = self.first or exc


def test_a_fake_process_0_without_the_secret_is_refused_by_the_follower():
    fake = FakeProcess0(WRONG_SECRET, [])
    follower = Follower(FakeRunner(), fake.address, 1, secret=SECRET)
    with pytest.raises(RelayAuthError, match="did not prove it holds the group's secret"):
        follower.connect(timeout_s=10)
    fake.thread.join(10)
    assert not isinstance(fake.first, CheckIn)  # the follower said nothing more
    genuine = FakeProcess0(SECRET, [frame(Stop())])  # control: with the secret, the follower checks in
    follower = Follower(FakeRunner(), genuine.address, 1, secret=SECRET)
    assert follower.run(follower.connect(timeout_s=10)) == 0
    genuine.thread.join(10)
    assert isinstance(genuine.first, CheckIn) and genuine.first.process_id == 1


@pytest.mark.parametrize("bad, match", [
    (b"\x00\x00\x00\x03abc", "not a msgpack message"),
    (b"\xff\xff\xff\xff", "over the limit"),
    (frame(Beat()), "sent a Beat message"),
    (len(p := msgpack.packb({"type": "call", "method": "__init__", "args": []})).to_bytes(4, "big") + p,
     "'__init__' is not a relayed runner call"),
])
def test_a_follower_exits_non_zero_on_a_malformed_frame_from_process_0(bad, match, caplog):
    runner = FakeRunner()
    fake = FakeProcess0(SECRET, [frame(Call("prefetch_decode", (3,))), bad, frame(Call("reset_state", ()))])
    follower = Follower(runner, fake.address, 1, secret=SECRET, heartbeat_s=60)
    with caplog.at_level(logging.ERROR, logger="zipage_jax"):
        assert follower.run(follower.connect(timeout_s=10)) == EXIT_STATUS
    fake.thread.join(10)
    assert runner.calls == [("prefetch_decode", (3,))]  # the calls before it ran, none after
    assert any(re.search(f"process 0 sent a malformed message .*{match}.*: exiting", r.getMessage())
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert isinstance(fake.last, Failed) and "malformed message from process 0" in fake.last.why


# -- the heartbeat ------------------------------------------------------------------------------


def test_a_follower_that_stops_beating_is_lost_within_the_timeout():
    lost = Lost()
    relay = _leader(lost, heartbeat_timeout_s=0.5)
    sock = _checked_in(relay)  # checks in, then hangs: no beat
    relay.attach(FakeRunner(), timeout_s=10)
    assert lost.exited.wait(10)
    assert lost.reasons == ["process 1 sent no heartbeat for 0.5 s (hung or stopped)"]
    assert lost.exits == [EXIT_STATUS]
    sock.close()


def test_a_follower_sending_a_malformed_frame_is_lost():
    lost = Lost()
    relay = _leader(lost)
    sock = _checked_in(relay)
    relay.attach(FakeRunner(), timeout_s=10)
    sock.sendall(frame(Beat()) + b"\x00\x00\x00\x02\xc1\xc1")  # a beat, then no msgpack
    assert lost.exited.wait(10)
    assert len(lost.reasons) == 1 and lost.reasons[0].startswith("process 1 sent a malformed message: not a msgpack")
    sock.close()


def test_a_beating_follower_is_kept_while_no_calls_come():
    lost = Lost()
    relay = _leader(lost, heartbeat_timeout_s=0.5)
    followed = _follow_in_thread(FakeRunner(), relay, heartbeat_s=0.05)
    relay.attach(FakeRunner(), timeout_s=10)
    assert not lost.exited.wait(2.0)  # four heartbeat timeouts without a call
    relay.close()
    followed["thread"].join(10)
    assert followed["status"] == 0 and not lost.reasons


# -- the secret, and no pickle ------------------------------------------------------------------


def test_the_secret_comes_from_the_file_else_the_environment_and_is_checked(tmp_path):
    path = tmp_path / "secret"
    path.write_text("file secret, long enough\n")
    env = {SECRET_ENV: "env secret, long enough too"}
    assert relay_secret(env, str(path)) == b"file secret, long enough"
    assert relay_secret(env, None) == b"env secret, long enough too"
    assert relay_secret({}, None) is None
    with pytest.raises(ValueError, match=f"cannot read the relay secret file {tmp_path / 'missing'}"):
        relay_secret(env, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=f"{SECRET_ENV}\\) must be at least 16 characters, got 5"):
        relay_secret({SECRET_ENV: "short"}, None)
    with pytest.raises(ValueError, match="at least 16 characters, got 0"):
        relay_secret({SECRET_ENV: ""}, None)
    path.write_text("\n")
    with pytest.raises(ValueError, match=f"file {path}\\) must be at least 16"):
        relay_secret({}, str(path))


def test_process_0_given_no_secret_generates_one_and_prints_how_to_pass_it(monkeypatch, capsys):
    from zipage_jax.commands.serve import _relay_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    secrets = [_relay_secret(argparse.Namespace(relay_secret_file=None, process_id=0)) for _ in range(2)]
    printed = capsys.readouterr().err
    assert secrets[0] != secrets[1] and all(len(s) >= relay_auth.MIN_SECRET_CHARS for s in secrets)
    for secret in secrets:
        assert f"{SECRET_ENV}={secret.decode()}" in printed and "--relay-secret-file" in printed
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())  # control: a given secret is used, nothing printed
    assert _relay_secret(argparse.Namespace(relay_secret_file=None, process_id=0)) == SECRET
    assert capsys.readouterr().err == ""


def test_a_follower_without_a_secret_is_a_usage_error_naming_both_ways(tmp_path):
    env = {k: v for k, v in _env(tmp_path).items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "zipage_jax", "serve", "--num-processes", "2", "--process-id", "1",
                           "--coordinator-address", f"127.0.0.1:{_free_port()}", "--tensor-parallel-size", "2"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "process 1 needs the group's relay secret" in done.stderr
    assert SECRET_ENV in done.stderr and "--relay-secret-file" in done.stderr


PICKLERS = ("pickle", "cPickle", "_pickle", "dill", "cloudpickle")


def _uses_pickle(source: str) -> bool:
    """Whether `source` imports a pickler (import, from-import, __import__ or import_module) or names one."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Call):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            names = [node.id] if isinstance(node, ast.Name) else []
        if any(n.split(".")[0] in PICKLERS for n in names):
            return True
    return False


def test_the_relay_modules_do_not_import_pickle():
    for user in ("import os\nimport pickle", "from pickle import loads", "__import__('pickle')",
                 "importlib.import_module('cloudpickle')", "import _pickle as p"):
        assert _uses_pickle(user), user  # control: each way in is seen
    assert not _uses_pickle('"""never a pickle."""\nimport msgpack')
    runner = ROOT / "zipage_jax" / "engine" / "runner"
    for name in RELAY_MODULES:
        assert not _uses_pickle((runner / name).read_text()), name


class RecordingRelay:
    """Process 0's relay as a follower would receive it: every published call, framed."""

    def __init__(self):
        self.frames: list[bytes] = []

    def publish(self, method: str, args: tuple) -> None:
        self.frames.append(frame(Call(method, args)))


@pytest.mark.slow
def test_a_replayed_runner_ends_in_process_0s_device_state(model, cache_dir):
    """The relayed calls are all a runner needs: a second runner replaying a single-process
    engine's calls through the follower loop (a reset, full KV, compressed, a penalised
    prefix-cache hit that seeds its history) ends with a bit-identical KV pool and sampler state."""
    import jax

    from zipage_jax import LLM, SamplingParams
    from zipage_jax.engine.runner.model_runner import ModelRunner

    llm = LLM(str(model), **{**OPTIONS, "compilation_cache_dir": None})
    engine, relay = llm.engine, RecordingRelay()
    engine.core.runner.relay = relay
    engine.core.runner.reset_state()
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=COMPRESSED_TOKENS, kv_budget=KV_BUDGET, **greedy),
                               SamplingParams(max_tokens=12, **greedy)], use_tqdm=False)
    penalised = SamplingParams(max_tokens=4, repetition_penalty=1.3, **greedy)
    for _ in range(2):  # the second time a prefix-cache hit: its history is seeded
        llm.generate([PROMPTS[0] * 2], penalised, use_tqdm=False)
    methods = [decode(f[HEADER_SIZE:]).method for f in relay.frames]
    assert {"run_forward", "run_compaction", "run_seed", "reset_state", "prefetch_decode"} <= set(methods)
    assert engine.stats.num_compressions > 0

    twin = ModelRunner(engine.core.loaded, engine.config, engine.core.pool, eos_token_ids=engine.core.eos_token_ids)
    leader_end, follower_end = socket.socketpair()
    with leader_end, follower_end:
        sender = threading.Thread(target=lambda: leader_end.sendall(b"".join(relay.frames) + frame(Stop())))
        sender.start()
        assert Follower(twin, ("unused", 0), 1, secret=SECRET).run(follower_end) == 0
        sender.join()
    for mine, replayed in zip(jax.tree.leaves(jax.device_get(engine.core.runner.state)),
                              jax.tree.leaves(jax.device_get(twin.state)), strict=True):
        np.testing.assert_array_equal(mine, replayed)


# -- two served processes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir: Path) -> dict:
    env = {**os.environ, "ZIPAGE_JAX_CACHE": str(cache_dir), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           SECRET_ENV: SECRET.decode()}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


class Group:
    """`zipage-jax serve` as processes 0 and 1 of a jax.distributed group, their output in files."""

    def __init__(self, model: Path, cache_dir: Path, logs: Path, *extra: str):
        self.http = f"http://127.0.0.1:{_free_port()}"
        self.coordinator = coordinator = f"127.0.0.1:{_free_port()}"
        cli = [sys.executable, "-m", "zipage_jax", "serve", "--model", str(model), "--port", self.http.rsplit(":")[-1],
               "--tensor-parallel-size", "2", "--num-processes", "2", "--coordinator-address", coordinator,
               "--relay-port", str(_free_port()), *_flags(OPTIONS), *extra]
        self.logs = [logs / f"process{i}.log" for i in range(2)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen([*cli, "--process-id", str(i)], env=_env(cache_dir), cwd=ROOT,
                                                   stdout=out, stderr=subprocess.STDOUT))

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.procs):
                assert proc.poll() is None, f"process {i} exited ({proc.returncode}):\n{self.log(i)[-4000:]}"
            try:
                if httpx.get(self.http + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise AssertionError(f"not healthy within {STARTUP_S} s:\n{self.log(0)[-4000:]}")

    def wait_exit(self, i: int, timeout: float) -> int:
        try:
            return self.procs[i].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {i} still runs {timeout} s on:\n{self.log(i)[-4000:]}") from None

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _flags(options: dict) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]


@pytest.fixture(scope="module")
def cache_dir(model_cache_dir) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPAGE_JAX_CACHE", str(model_cache_dir))
        yield model_cache_dir


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    """6 query / 2 kv heads (head_dim 16) with q/k/v biases: splits over 2 devices."""
    return tiny_model_factory("qwen2", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference(model, cache_dir) -> dict:
    """One process's (one device's) greedy texts and log-probabilities, full KV and compressed.
    It also fills the parameter cache the served processes read (several processes do not write it)."""
    from zipage_jax import LLM, SamplingParams

    llm = LLM(str(model), **OPTIONS)
    full = SamplingParams(temperature=0, max_tokens=FULL_TOKENS, ignore_eos=True, logprobs=1)
    compressed = SamplingParams(temperature=0, max_tokens=COMPRESSED_TOKENS, ignore_eos=True, logprobs=1,
                                kv_budget=KV_BUDGET)
    before = llm.engine.stats.num_compressions
    results = {"full": llm.generate(PROMPTS, full, use_tqdm=False),
               "compressed": llm.generate(PROMPTS[:2], compressed, use_tqdm=False)}
    results["compressions"] = llm.engine.stats.num_compressions - before
    assert results["compressions"] > 0
    return results


def _completion(group: Group, prompts: list[list[int]], max_tokens: int, **extra) -> list[dict]:
    body = {"model": "m", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}
    response = httpx.post(group.http + "/v1/completions", json=body, timeout=STARTUP_S)
    assert response.status_code == 200, response.text
    return sorted(response.json()["choices"], key=lambda c: c["index"])


def _stream(group: Group, prompt: list[int], max_tokens: int, on_event=None, timeout: float = STARTUP_S) -> list:
    """The SSE events' bodies (dicts), then "[DONE]"."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.stream("POST", group.http + "/v1/completions", json=body, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if on_event is not None:
                    on_event(events)
    return events


def _assert_same(choices: list[dict], expected: list[dict]) -> None:
    assert [c["text"] for c in choices] == [r["text"] for r in expected]
    for choice, result in zip(choices, expected):
        served = choice["logprobs"]["token_logprobs"]
        one = [lp["logprob"] for lp in result["logprobs"]]
        assert len(served) == len(one) == len(result["token_ids"])
        np.testing.assert_allclose(served, one, atol=1e-4)  # the same tokens: their log-probabilities agree


def _compressions(group: Group) -> float:
    metrics = httpx.get(group.http + "/metrics", timeout=30).text
    return float(re.search(r"^zipage:compressions_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))


@pytest.fixture
def group_factory(model, cache_dir, reference, tmp_path):
    groups = []

    def start(*extra: str) -> Group:
        group = Group(model, cache_dir, tmp_path, "--served-model-name", "m", *extra)
        groups.append(group)
        group.wait_healthy()
        return group

    yield start
    for group in groups:
        group.stop()


@pytest.mark.slow
def test_two_processes_serve_one_processs_greedy_tokens_full_and_compressed(group_factory, reference):
    group = group_factory()  # warming up in the background, the follower too
    _assert_same(_completion(group, PROMPTS, FULL_TOKENS), reference["full"])
    events = _stream(group, PROMPTS[0], FULL_TOKENS)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == reference["full"][0]["text"]
    _assert_same(_completion(group, PROMPTS[:2], COMPRESSED_TOKENS, kv_budget=KV_BUDGET), reference["compressed"])
    assert _compressions(group) == reference["compressions"]
    listeners = [entry for proc in group.procs for entry in tcp_listeners(process_tree(proc.pid))]
    assert [entry for entry in listeners if not is_loopback(entry[2])] == [], listeners
    coordinator_port = int(group.coordinator.rsplit(":", 1)[1])
    assert {int(group.http.rsplit(":", 1)[1]), coordinator_port} <= {port for *_, port in listeners}, listeners
    assert len({pid for pid, *_ in listeners}) >= 2, listeners  # both processes listen (gloo), on loopback alone
    group.procs[1].send_signal(signal.SIGTERM)  # a supervisor stops every process: the follower waits for process 0
    group.procs[0].send_signal(signal.SIGTERM)  # a clean stop: the follower is told and exits 0
    assert group.wait_exit(0, EXIT_BOUND_S) == 0  # a graceful stop (server/shutdown.py)
    assert group.wait_exit(1, EXIT_BOUND_S) == 0


@pytest.mark.slow
def test_a_killed_follower_fails_the_requests_in_flight_and_process_0_exits(group_factory):
    group = group_factory("--no-warmup")
    _completion(group, PROMPTS[:2], 8)  # the prefill and decode programs compile now, not during the kill
    streamed_some = threading.Event()
    stream: dict = {}

    def read_stream() -> None:
        try:
            stream["events"] = _stream(group, PROMPTS[1], 400, lambda events: len(events) > 3 and streamed_some.set(),
                                       timeout=EXIT_BOUND_S)
        except Exception as exc:  # noqa: BLE001 - asserted below
            stream["error"] = exc

    whole: dict = {}

    def post_whole() -> None:
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        try:
            whole["response"] = httpx.post(group.http + "/v1/completions", json=body, timeout=EXIT_BOUND_S)
        except Exception as exc:  # noqa: BLE001 - asserted below
            whole["error"] = exc

    threads = [threading.Thread(target=read_stream), threading.Thread(target=post_whole)]
    for thread in threads:
        thread.start()
    assert streamed_some.wait(EXIT_BOUND_S), group.log(0)[-4000:]
    group.procs[1].kill()
    killed = time.monotonic()
    assert group.wait_exit(0, EXIT_BOUND_S) == 1
    exited_after = time.monotonic() - killed
    for thread in threads:
        thread.join(EXIT_BOUND_S)
    assert "error" not in stream, stream.get("error")
    events = stream["events"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events[-3:]
    assert len(events) < 400  # it ended early
    assert "error" not in whole, whole.get("error")
    assert whole["response"].status_code == 500, whole["response"].text
    assert re.search(r"relay: the connection to process 1 closed .*failing the requests in flight", group.log(0))
    assert exited_after < EXIT_BOUND_S


@pytest.mark.slow
def test_a_killed_process_0_ends_its_follower(group_factory):
    group = group_factory("--no-warmup")
    group.procs[0].kill()
    assert group.wait_exit(1, EXIT_BOUND_S) != 0
