"""The engine core in a process of its own (the server's default, as vLLM's engine core):

    python -m zipage_jax.engine.core_process FD

FD is this process's end of a socket pair its parent made (nothing listens anywhere). The first
frame is {"op": "start", "config": EngineConfig fields, "log_level": ...}; the process loads the
model, answers {"ev": "loaded", "info": ModelInfo} (or {"ev": "load_failed", "message": ...}
and exits 1), then runs an EngineDriver: the parent's commands come in as frames, the driver's
events go out as frames (engine/wire.py: msgpack, nothing pickled). It exits when told to stop
(0), when its parent's end closes (0), or when the core fails for good (1). It ignores SIGINT:
Ctrl-C reaches the whole process group, and the parent stops it in order.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading

from zipage_jax.engine import driver, wire

logger = logging.getLogger("zipage_jax")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = wire.Channel(socket.socket(fileno=int(argv[0])))
    start = channel.recv()
    if start is None or start.get("op") != "start":
        return 1
    logging.basicConfig(level=str(start.get("log_level", "info")).upper(),
                        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    try:
        from zipage_jax.engine.core import EngineCore

        core = EngineCore(wire.config_from_wire(start["config"]))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it and exits
        logger.exception("loading the model failed")
        channel.send({"ev": "load_failed", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    channel.send({"ev": "loaded", "info": wire.model_info_to_wire(core.model_info)})
    fatal = threading.Event()

    def publish(event: driver.Event) -> None:
        if isinstance(event, driver.Fatal):
            fatal.set()
        channel.send(wire.event_to_wire(event))

    engine = driver.EngineDriver(core, publish)
    threading.Thread(target=_read_commands, args=(channel, engine), name="zipage-commands", daemon=True).start()
    engine.run()
    return 1 if fatal.is_set() else 0


def _read_commands(channel: wire.Channel, engine: driver.EngineDriver) -> None:
    """The parent's commands into the driver, until it says stop or its end closes."""
    try:
        while (message := channel.recv()) is not None:
            command = wire.command_from_wire(message)
            if isinstance(command, driver.Stop):
                break
            engine.submit(command)
    except (OSError, ValueError):
        logger.exception("reading the server's commands failed")
    engine.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
