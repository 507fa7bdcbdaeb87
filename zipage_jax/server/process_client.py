"""MultiProcessEngineClient: the server's engine core in a process of its own (the default).

The child (engine/core_process.py) loads the model and runs the engine's driver; this process
keeps the HTTP server, tokenization and the output stage (server/engine_client.py). They talk
over a socket pair (engine/wire.py: msgpack frames, nothing pickled, nothing listening). So the
engine's steps never wait for detokenization, stop strings or response building, and those never
wait for a step.

The tokenizer is this process's own: loaded (from the parameter cache the child has just filled,
or the model's source) once the child reports its model loaded. The child's death (a crash, an
OOM kill) ends every request in flight with an error and makes the engine unusable: the server
exits with status 1 (`on_engine_error`).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading

from zipage_jax.config import EngineConfig
from zipage_jax.engine import driver, wire
from zipage_jax.server.engine_client import FrontEnd

logger = logging.getLogger("zipage_jax.server")


class MultiProcessEngineClient(FrontEnd):
    def __init__(self, config: EngineConfig, log_level: str = "info"):
        super().__init__()
        self.config, self._log_level = config, log_level
        self._proc: subprocess.Popen | None = None
        self._channel: wire.Channel | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The engine core process's id (None before it started)."""
        return None if self._proc is None else self._proc.pid

    def _start_core(self) -> None:
        parent, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "zipage_jax.engine.core_process", str(child.fileno())],
                                          pass_fds=(child.fileno(),))
        finally:
            child.close()
        self._channel = wire.Channel(parent)
        self._channel.send({"op": "start", "config": wire.config_to_wire(self.config), "log_level": self._log_level})
        self._reader = threading.Thread(target=self._read, name="zipage-core-reader", daemon=True)
        self._reader.start()

    def _stop_core(self, timeout: float) -> None:
        if self._channel is not None:
            try:
                self._send(driver.Stop())
            except OSError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core process did not stop in %g s: killing it", timeout)
                self._proc.kill()
                self._proc.wait()
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None:
            self._reader.join(timeout)

    def _send(self, command: driver.Command) -> None:
        self._channel.send(wire.command_to_wire(command))

    def _read(self) -> None:
        """The child's frames: its load, then its driver's events (to the output thread)."""
        try:
            while (message := self._channel.recv()) is not None:
                event = message.get("ev")
                if event == "loaded":
                    self._on_model_loaded(wire.model_info_from_wire(message["info"]))
                elif event == "load_failed":
                    self._load_failed(RuntimeError(f"the engine core could not load the model: {message['message']}"))
                else:
                    self._publish(wire.event_from_wire(message))
        except (OSError, ValueError) as exc:
            if not self._stopping:
                logger.exception("reading the engine core's messages failed")
                self._publish(driver.Fatal(f"the engine core's messages could not be read: {exc}"))
            return
        if not self._stopping:
            status = self._proc.wait() if self._proc is not None else None
            message = f"the engine core process exited (status {status})"
            if not self.ready.is_set() and self.load_error is None:
                self._load_failed(RuntimeError(message))
            else:
                self._publish(driver.Fatal(message))

    def _on_model_loaded(self, info) -> None:
        from zipage_jax.models.loading import load_tokenizer

        config = self.config
        try:
            tokenizer = load_tokenizer(config.model, revision=config.revision, download_dir=config.download_dir)
        except BaseException as exc:  # noqa: BLE001 - no tokenizer, no server
            self._load_failed(exc)
            return
        self._loaded(tokenizer, info)
