"""Free TCP ports on 127.0.0.1 for the processes a test starts."""

from __future__ import annotations

import random
from pathlib import Path

from dilocox_p2p.endpoints import bindable, free_ports

LOWEST = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(consecutive: int = 1) -> int:
    """A port P such that P .. P + consecutive - 1 are free on 127.0.0.1 now (a peer's stage s listens on P + s).

    Taken below the kernel's ephemeral range where there is one: every port the kernel hands out by itself (a
    launcher fixing a tcp/0 address, an outgoing connection) comes from that range, so a port picked here
    cannot be taken by one of them before the peer it was picked for binds it (seen once: "address already
    in use" for the first peer's pre-known address, in a test whose other peers were starting beside it)."""
    top = _ephemeral_low() - consecutive
    if top - LOWEST < 1000:
        return free_ports("127.0.0.1", consecutive)
    for _ in range(100):
        port = random.randrange(LOWEST, top)
        if all(bindable("127.0.0.1", port + i) for i in range(consecutive)):
            return port
    return free_ports("127.0.0.1", consecutive)
