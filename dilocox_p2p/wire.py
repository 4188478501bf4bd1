"""Bytes on the wire: the protocol version, and checked decoding of the protobuf messages in proto/.

Every payload a worker accepts from another peer is decoded here, with a size limit
checked before parsing; what is refused raises `WireRejected` with the reason, which the
caller logs and counts. Payloads travel inside signed envelopes (envelope.py).
"""

from __future__ import annotations

import math
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from . import injection
from .errors import WireRejected
from .proto_gen import swarm_pb2

__all__ = ["MAX_RECORD_BYTES", "PROTOCOL_VERSION", "decode", "encode", "protocol_version", "swarm_pb2"]

MAX_RECORD_BYTES = 64 * 1024
PROTOCOL_VERSION = 8  # 8: every stream reply ends with END_OF_REPLY and its caller closes the stream (stream_close.py)
"""Bumped whenever a message changes meaning; peers speaking another version are refused
(the config hash covers it too, so such a peer is told at once that it belongs to another run)."""
M = TypeVar("M", bound=Message)


def protocol_version() -> int:
    """The version this process speaks (tests arm `speak_other_protocol` to play a peer running other code)."""
    return PROTOCOL_VERSION + 1 if injection.armed("speak_other_protocol", quiet=True) else PROTOCOL_VERSION


def encode(message: Message) -> bytes:
    return message.SerializeToString()


def decode(cls: type[M], blob: object, *, max_bytes: int = MAX_RECORD_BYTES) -> M:
    """Parse `blob` as `cls`; raise WireRejected naming what is wrong with it."""
    if not isinstance(blob, bytes):
        raise WireRejected(f"{cls.__name__}: expected bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise WireRejected(f"{cls.__name__}: {len(blob)} bytes > limit {max_bytes}")
    message = cls()
    try:
        message.ParseFromString(blob)
    except DecodeError as e:
        raise WireRejected(f"{cls.__name__}: malformed ({e})") from None
    for field, value in message.ListFields():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireRejected(f"{cls.__name__}: non-finite {field.name}")
    return message
