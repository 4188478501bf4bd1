"""The Hello exchange: every dilocox node (stage worker, bootstrap node) says who it is over libp2p.

    serve_hello(dht, role="peer", run_id="run-1")        # in the DHT's own process (its p2p daemon)
    reply = await say_hello(p2p, peer_id, timeout=3.0)   # from any hivemind P2P connected to it

The reply (control.proto `HelloReply`) names the software, its version, the wire protocol
version, the node's role and run, and its clock, so that `dilocox-peer doctor` can tell a
dilocox node from any other libp2p node, a node running incompatible code, and a skewed
clock (hivemind's DHT expirations are absolute times: a clock ahead or behind by more
than a record's lifetime makes its records vanish or linger).

The handler is a unary libp2p protobuf handler named "dilocox.v1.Hello"; it reads nothing
from the request but its time and answers the same to anyone (nothing in it is secret).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID

from .. import __version__
from ..proto_gen.control_pb2 import HelloReply, HelloRequest
from ..wire import protocol_version
from .dht_process import dht_result
from .dial_back import serve_dial_back

__all__ = ["HELLO", "SOFTWARE", "say_hello", "serve_hello"]

REGISTER_TIMEOUT_S = 30.0  # registering a handler is one round trip to the local p2p daemon

logger = logging.getLogger(__name__)

HELLO = "dilocox.v1.Hello"
"""The libp2p protocol name of the handler."""
SOFTWARE = "dilocox-p2p"
"""What `HelloReply.software` says for this package."""


async def _answer(role: str, run_id: str, request: HelloRequest, context: P2PContext) -> HelloReply:
    return HelloReply(
        software=SOFTWARE, version=__version__, protocol=protocol_version(), role=role, time=time.time(), run_id=run_id
    )


async def _register(role: str, run_id: str, _dht: hivemind.DHT, node: DHTNode) -> None:
    await node.p2p.add_protobuf_handler(HELLO, functools.partial(_answer, role, run_id), HelloRequest)
    await serve_dial_back(node.p2p)


def serve_hello(dht: hivemind.DHT, *, role: str, run_id: str = "") -> None:
    """Answer Hello (and dial_back.DIAL_BACK) on `dht`'s p2p daemon, from inside the DHT process (so it lives as
    long as the node).

    Args:
        dht: a started hivemind DHT (its node runs in a child process).
        role: "bootstrap" or "peer".
        run_id: the run this node trains in ("" for a bootstrap node, which serves any run).

    Raises:
        TimeoutError: the handler was not registered within REGISTER_TIMEOUT_S.
        SwarmError: the DHT process died.
    """
    future = dht.run_coroutine(functools.partial(_register, role, run_id), return_future=True)
    dht_result(dht, future, f"registering the {HELLO} handler", deadline=time.monotonic() + REGISTER_TIMEOUT_S)
    logger.debug("answering %s as %s", HELLO, role)


async def say_hello(p2p: P2P, peer_id: PeerID, timeout: float) -> HelloReply:
    """Ask `peer_id` who it is. The caller's p2p must already know how to reach it (connected).

    Raises:
        asyncio.TimeoutError: no reply within `timeout` seconds.
        hivemind.p2p.P2PHandlerError / P2PDaemonError: the node does not answer Hello (not a dilocox
            node) or the stream failed.
    """
    request = HelloRequest(time=time.time())
    return await asyncio.wait_for(p2p.call_protobuf_handler(peer_id, HELLO, request, HelloReply), timeout)
