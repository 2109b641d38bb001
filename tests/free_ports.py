"""Ports for the services and rendezvous the tests start, one rule for every test folder.

A port is picked below the kernel's ephemeral range (the process binds it seconds later, and meanwhile
no port-0 bind nor outgoing connection of another process is handed it), and never twice in one
process: two picks made before either is bound (a trainer's and a sampler's) could otherwise match."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
_handed_out: set[int] = set()


def free_port() -> int:
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
