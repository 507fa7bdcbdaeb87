"""One model served by several processes: process 0 runs the server and the scheduler, every
other process (a follower) makes each device call process 0's runner makes, with the same host
inputs, so the SPMD programs of a multi-process mesh run in lockstep.

The cut is the runner, the one door to the device: its methods named in RELAYED are every call
that runs a program on the mesh (a forward step, a compaction, a history seeding, a fresh device
state) or builds one ahead (the next decode step). Before process 0's runner runs one it sends
the method's name and host arguments (numpy arrays, shape keys) to every follower
(`LeaderRelay.publish`); a follower (`Follower.run`) calls the same method on its own runner,
built from the same command. Programs compile where they run (a follower builds a program when
its first call arrives, unless its own warm-up did): compiling is local, and calls that execute
arrive in process 0's order, on one connection each.

Transport: one TCP connection from each follower to process 0, on the coordinator's host at
`relay_address` (the coordinator's port + 1 unless given). Before process 0 reads anything else
from a connection, both ends prove they hold the group's secret (relay_auth.py: an HMAC
challenge and response each way, fixed sizes read within HANDSHAKE_TIMEOUT_S); only then does
process 0 read the follower's check-in (its process id and runner signature). Every message is
a length-prefixed msgpack frame of a fixed schema (relay_wire.py), never a pickle. A connection
that fails the handshake or sends a malformed, oversized or unknown message before checking in
is dropped with a warning, and process 0 goes on waiting for its real followers; handshakes run
on threads of their own (at most MAX_HANDSHAKES at once), so a silent connection stalls nothing.

Heartbeat: a follower sends a beat every HEARTBEAT_S (1 s) from a thread of its own, so it
beats while it compiles or waits on a long device call; process 0 takes a follower from which
no frame came for HEARTBEAT_TIMEOUT_S (10 s) as lost (hung, or stopped).

Faults: a follower whose connection closes (it died, or its call failed: it says why first),
that stops beating, or that sends a malformed message makes process 0 give up: `on_lost(reason)`
(the server fails the requests in flight and stops) and, EXIT_GRACE_S later if the process is
still alive (blocked in a collective that waits for the dead peer), a hard exit with status 1.
A follower exits with status 1 when process 0's connection closes or sends a malformed message,
and with 0 when process 0 stops cleanly (`LeaderRelay.close`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable

from zipage_jax.engine.distributed import split_address
from zipage_jax.engine.runner.executable_store import HOST_ONLY_OPTIONS
from zipage_jax.engine.runner.relay_auth import prove_follower, prove_leader, read_greeting
from zipage_jax.engine.runner.relay_wire import (
    RELAYED,
    Beat,
    Call,
    CheckIn,
    Failed,
    Message,
    RelayProtocolError,
    Stop,
    frame,
    read_message,
)
from zipage_jax.engine.runner.warmup import Warmup

logger = logging.getLogger("zipage_jax")

__all__ = ["RELAYED", "EXIT_STATUS", "Follower", "LeaderRelay", "PeerLost", "exit_now", "follow", "relay_address",
           "runner_signature"]

CONNECT_TIMEOUT_S = 300.0  # how long process 0 waits for its followers once its own engine is built, and they for it
HANDSHAKE_TIMEOUT_S = 5.0  # a connection's handshake and check-in, from its accept
MAX_HANDSHAKES = 16  # connections in their handshake at once; more are closed at once (a follower tries again)
HEARTBEAT_S = 1.0  # a follower's beat
HEARTBEAT_TIMEOUT_S = 10.0  # no frame from a follower for this long: it is lost
EXIT_GRACE_S = 5.0  # after a follower is lost: the longest process 0 lets the server fail requests and stop
EXIT_STATUS = 1
_ACCEPT_POLL_S = 0.2  # how often the accepting thread looks whether it should stop


class PeerLost(RuntimeError):
    """A process of the group is gone: the group cannot run another step."""


# -- where and what --------------------------------------------------------------------------


def relay_address(coordinator_address: str | None, relay_port: int | None = None) -> tuple[str, int]:
    """(host, port) of process 0's relay: the coordinator's host ("[::1]:1234" -> "::1"), and
    `relay_port`, else the coordinator's port + 1."""
    if coordinator_address is None:
        raise ValueError("several processes need --coordinator-address HOST:PORT (process 0's host)")
    host, port = split_address(coordinator_address)
    port_number = port + 1 if relay_port is None else relay_port
    if not 0 < port_number < 65536:
        raise ValueError(f"the relay port must be in [1, 65535], got {port_number}")
    return host, port_number


def runner_signature(runner) -> dict[str, str]:
    """What must be equal in every process's runner for their programs to match: the engine
    options that shape programs, the KV pool and the model's config."""
    options = {k: repr(v) for k, v in dataclasses.asdict(runner.config).items() if k not in HOST_ONLY_OPTIONS}
    return {**options, "KV pool": repr(runner.pool), "model config": repr(runner.model_config)}


# -- process 0 -------------------------------------------------------------------------------


class LeaderRelay:
    """Process 0's side: listens at once and admits the followers that prove they hold `secret`
    (they connect when their engine is built), `attach` waits for them all and hooks the runner,
    `publish` sends one call to every follower."""

    def __init__(self, host: str, port: int, num_followers: int, on_lost: Callable[[str], None], *,
                 secret: bytes, exit_grace_s: float = EXIT_GRACE_S, hard_exit: Callable[[int], object] = os._exit,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.num_followers = num_followers
        self._on_lost, self._exit_grace_s, self._hard_exit = on_lost, exit_grace_s, hard_exit
        self._secret, self._handshake_timeout_s = secret, handshake_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._listener = socket.create_server((host, port), family=_family(host), backlog=max(num_followers, 16))
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]  # port 0: the one the system chose
        self._followers: dict[int, socket.socket] = {}
        self._checked_in: queue.Queue[tuple[CheckIn, socket.socket]] = queue.Queue()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._accepting = True
        self._send_lock = threading.Lock()
        self._lost_lock = threading.Lock()
        self.lost: str | None = None  # why the group broke
        self._closing = False
        threading.Thread(target=self._accept, name="zipage-relay-accept", daemon=True).start()

    def attach(self, runner, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Waits until every follower has checked in with the same runner as this one's, then
        relays `runner`'s device calls; TimeoutError / ValueError say which process did not come
        or differs."""
        mine = runner_signature(runner)
        deadline = time.monotonic() + timeout_s
        try:
            while len(self._followers) < self.num_followers:
                missing = sorted(set(range(1, self.num_followers + 1)) - set(self._followers))
                try:
                    check_in, sock = self._checked_in.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"process(es) {', '.join(map(str, missing))} did not connect to the relay at "
                        f"{_show(self.address)} within {timeout_s:.0f} s (every process runs the same command, with "
                        "its own --process-id and the same relay secret; is the port reachable?)") from None
                self._admit(check_in, sock, mine, missing)
        finally:
            self._accepting = False
        for process_id, sock in self._followers.items():
            threading.Thread(target=self._watch, args=(process_id, sock), name=f"zipage-relay-watch-{process_id}",
                             daemon=True).start()
        runner.relay = self
        logger.info("relay: %d follower process(es) connected at %s", self.num_followers, _show(self.address))

    def publish(self, method: str, args: tuple) -> None:
        """Sends one runner call to every follower; PeerLost once one is gone."""
        message = frame(Call(method, args))
        with self._send_lock:
            if self.lost is not None:
                raise PeerLost(self.lost)
            for process_id, sock in self._followers.items():
                try:
                    sock.sendall(message)
                except OSError as exc:
                    self._lose(f"sending to process {process_id} failed: {exc}")
                    raise PeerLost(self.lost) from exc

    def close(self) -> None:
        """A clean stop: every follower returns (status 0)."""
        self._closing = True
        self._accepting = False
        with self._send_lock:
            for sock in self._followers.values():
                try:
                    sock.sendall(frame(Stop()))
                except OSError:
                    pass  # it is gone already
                sock.close()

    def _accept(self) -> None:
        """Accepts connections until every follower has checked in, each handshake on a thread of its own."""
        with self._listener:
            while self._accepting:
                try:
                    sock, peer = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    logger.warning("relay: accepting a connection failed: %s", exc)
                    continue
                if not self._handshakes.acquire(blocking=False):
                    sock.close()
                    logger.warning("relay: dropped a connection from %s: %d others are in their handshake",
                                   _show(peer[:2]), MAX_HANDSHAKES)
                    continue
                threading.Thread(target=self._handshake, args=(sock, peer[:2]), name="zipage-relay-handshake",
                                 daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        """A connection's proof and check-in, within the handshake timeout, or it is dropped."""
        try:
            deadline = time.monotonic() + self._handshake_timeout_s
            prove_leader(sock, self._secret, deadline)
            message = read_message(sock, deadline)
            if not isinstance(message, CheckIn):
                raise RelayProtocolError(f"its first message was a {type(message).__name__}, not a check-in")
        except (RelayProtocolError, OSError, EOFError) as exc:  # TimeoutError is an OSError
            sock.close()
            logger.warning("relay: dropped a connection from %s: %s", _show(peer), exc)
            return
        finally:
            self._handshakes.release()
        self._checked_in.put((message, sock))

    def _admit(self, check_in: CheckIn, sock: socket.socket, mine: dict[str, str], missing: list[int]) -> None:
        """A follower that proved it holds the secret: ValueError unless it is one awaited, with this runner."""
        process_id, theirs = check_in.process_id, check_in.signature
        if process_id not in missing:
            sock.close()
            raise ValueError(f"process {process_id!r} connected to the relay, which waits for process(es) "
                             f"{', '.join(map(str, missing))} (each of 1 .. {self.num_followers} once)")
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            sock.close()
            raise ValueError(f"process {process_id} built a different engine than process 0 ({', '.join(differ)} "
                             "differ): every process must run the same command")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._followers[process_id] = sock

    def _watch(self, process_id: int, sock: socket.socket) -> None:
        """A follower sends beats, and why its call failed if one did; a closed connection, a
        malformed message or no beat within the heartbeat timeout is a lost follower."""
        timeout_s = self._heartbeat_timeout_s
        try:
            message: Message = Beat()
            while isinstance(message, Beat):
                message = read_message(sock, time.monotonic() + timeout_s)
            reason = (f"process {process_id} failed: {message.why}" if isinstance(message, Failed)
                      else f"process {process_id} sent a {type(message).__name__} message, which followers do not")
        except TimeoutError:
            reason = f"process {process_id} sent no heartbeat for {timeout_s:g} s (hung or stopped)"
        except RelayProtocolError as exc:
            reason = f"process {process_id} sent a malformed message: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever broke the connection, the follower is gone
            reason = f"the connection to process {process_id} closed ({type(exc).__name__}: {exc})"
        if not self._closing:
            self._lose(reason)

    def _lose(self, reason: str) -> None:
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = reason
        logger.error("relay: %s; failing the requests in flight and exiting (status %d)", reason, EXIT_STATUS)
        for sock in self._followers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a send in progress fails now
            except OSError:
                pass
        threading.Thread(target=self._exit_after_grace, name="zipage-relay-exit", daemon=True).start()
        self._on_lost(reason)

    def _exit_after_grace(self) -> None:
        time.sleep(self._exit_grace_s)
        logger.error("relay: still running %.0f s after losing a follower: exiting", self._exit_grace_s)
        exit_now(self._hard_exit)


def exit_now(hard_exit: Callable[[int], object] = os._exit) -> None:
    """Exits with EXIT_STATUS at once (output flushed): neither waiting for threads blocked on
    the device nor for jax.distributed's shutdown barrier, which a lost process never reaches."""
    sys.stdout.flush()
    sys.stderr.flush()
    hard_exit(EXIT_STATUS)


# -- the other processes ---------------------------------------------------------------------


class Follower:
    """A follower process's side: connects to process 0, proves it holds `secret`, and replays
    process 0's runner calls, beating every `heartbeat_s` meanwhile."""

    def __init__(self, runner, address: tuple[str, int], process_id: int, *, secret: bytes,
                 heartbeat_s: float = HEARTBEAT_S):
        self.runner, self.address, self.process_id = runner, address, process_id
        self._secret, self._heartbeat_s = secret, heartbeat_s
        self._send_lock = threading.Lock()  # the beat thread and the replay loop both send
        self._last_call = 0.0

    def busy(self) -> bool:
        """Calls arrived within the last second (a warm-up then starts no program)."""
        return time.monotonic() - self._last_call < 1.0

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> socket.socket:
        """The connection to process 0, both ends proven and this process checked in (retried
        until process 0 listens); RelayAuthError when either end's proof fails."""
        deadline = time.monotonic() + timeout_s
        while True:
            sock = None
            try:
                sock = socket.create_connection(self.address, timeout=max(0.1, deadline - time.monotonic()))
                sock.settimeout(None)
                nonce = read_greeting(sock, deadline)
                break
            except (OSError, EOFError) as exc:  # not listening yet, or busy: again
                if sock is not None:
                    sock.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"process 0's relay at {_show(self.address)} did not answer within "
                                       f"{timeout_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
        try:
            prove_follower(sock, self._secret, nonce, deadline)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._send(sock, CheckIn(self.process_id, runner_signature(self.runner)))
        except BaseException:
            sock.close()
            raise
        return sock

    def run(self, sock: socket.socket) -> int:
        """Replays calls until process 0 stops: 0 when it stopped cleanly, EXIT_STATUS when its
        connection closed, it sent a malformed message, or a call failed (process 0 is told why)."""
        stopped = threading.Event()
        threading.Thread(target=self._beat, args=(sock, stopped), name="zipage-relay-heartbeat", daemon=True).start()
        try:
            return self._replay(sock)
        finally:
            stopped.set()

    def _replay(self, sock: socket.socket) -> int:
        while True:
            try:
                message = read_message(sock)
                if not isinstance(message, Call | Stop):
                    raise RelayProtocolError(f"process 0 sent a {type(message).__name__} message, which it does not")
            except RelayProtocolError as exc:
                logger.error("relay: process 0 sent a malformed message (%s): exiting", exc)
                self._tell_failed(sock, f"a malformed message from process 0: {exc}")
                return EXIT_STATUS
            except (OSError, EOFError) as exc:
                logger.error("relay: process 0's connection closed (%s: %s): exiting", type(exc).__name__, exc)
                return EXIT_STATUS
            if isinstance(message, Stop):
                logger.info("relay: process 0 stopped")
                sock.close()
                return 0
            self._last_call = time.monotonic()
            try:
                getattr(self.runner, message.method)(*message.args)
            except Exception as exc:  # noqa: BLE001 - this process cannot follow any more: process 0 learns why
                logger.exception("relay: replaying %s failed: exiting", message.method)
                self._tell_failed(sock, f"{message.method}: {type(exc).__name__}: {exc}")
                return EXIT_STATUS

    def _beat(self, sock: socket.socket, stopped: threading.Event) -> None:
        while not stopped.wait(self._heartbeat_s):
            try:
                self._send(sock, Beat())
            except OSError:
                return  # the connection is gone: the replay loop sees it too

    def _tell_failed(self, sock: socket.socket, why: str) -> None:
        try:
            self._send(sock, Failed(why))
        except OSError:
            pass

    def _send(self, sock: socket.socket, message: Message) -> None:
        data = frame(message)
        with self._send_lock:
            sock.sendall(data)


def follow(runner, address: tuple[str, int], process_id: int, warmup: bool, secret: bytes) -> int:
    """A follower's life: connects to process 0, builds the program grid in the background like
    process 0 (`warmup`), and replays calls until process 0 stops (Follower.run's status)."""
    follower = Follower(runner, address, process_id, secret=secret)
    sock = follower.connect()
    if warmup:
        Warmup(runner.step_grid(), busy=follower.busy).start()
    return follower.run(sock)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _show(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
