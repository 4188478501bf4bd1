"""Free TCP ports on 127.0.0.1 for the processes a test starts."""

from __future__ import annotations

from dilocox_p2p.endpoints import free_ports


def free_port(consecutive: int = 1) -> int:
    """A port P such that P .. P + consecutive - 1 are free on 127.0.0.1 now (a peer's stage s listens on P + s),
    below the kernel's ephemeral range, as a peer's launcher picks them for a tcp/0 address (endpoints.free_ports)."""
    return free_ports("127.0.0.1", consecutive)
