"""Which TCP sockets a set of processes listens on, and whether an address is loopback: the checks
that a server, a Ray cluster or a process group listens nowhere it was not asked to."""

from __future__ import annotations

import ipaddress

import psutil


def is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's loopback
    return (mapped or address).is_loopback


def tcp_listeners(processes: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, host, port) of every listening TCP socket of these processes."""
    found = []
    for proc in processes:
        try:
            found += [(proc.pid, proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:  # ended while listed (a worker Ray let go)
            continue
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and every process it started (still alive)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]
