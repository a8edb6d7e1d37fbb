"""Ports for the servers a test's ``rlbus run`` starts on loopback."""

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port_block(count: int = 4) -> int:
    """A first port N with N … N+count−1 free on 127.0.0.1, below the kernel's ephemeral range: no outgoing
    connection takes one of them between this check and the run binding it. (With a port bound to 0, ``rlbus run``'s
    second server, on N+1, found that port taken by some connection's local end and the run stopped.)"""
    lowest_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 32768
    for _ in range(100):
        first = random.randrange(10_000, lowest_ephemeral - count)
        if all(_free(port) for port in range(first, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 in [10000, {lowest_ephemeral})")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
