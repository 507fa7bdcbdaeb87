"""Multi-process start-up (jax.distributed, gloo collectives on CPU) that listens only where the
user pointed the group.

Left to their defaults, jax.distributed's coordination service binds every interface and gloo
binds the address this host's name resolves to. Here the coordinator binds the host of
--coordinator-address (the address the user named for it), and each process's gloo binds the
local address its packets to the coordinator leave from: loopback for a group on one machine
(coordinator 127.0.0.1 or ::1), the right interface for a group across hosts.
"""

from __future__ import annotations

import socket

import jax
from jax._src import distributed, xla_bridge
from jax._src.lib import _jax


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> None:
    """jax.distributed.initialize for a multi-process run; call before anything touches a JAX
    device. Does nothing when no coordinator is given."""
    if coordinator_address is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError("--num-processes and --process-id need --coordinator-address")
        return
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id must be in [0, {num_processes}), got {process_id}")
    host, port = split_address(coordinator_address)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, coordinator_bind_address=coordinator_address)
    local = local_address_towards(host, port)
    xla_bridge.register_backend_factory(  # the CPU client's collectives: gloo on `local` alone
        "cpu", lambda: xla_bridge.make_cpu_client(collectives=_jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=local)),
        priority=0, fail_quietly=False)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "HOST:PORT" ("[::1]:1234" -> ("::1", 1234)); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"the coordinator address must be HOST:PORT, got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]
