"""Bytes on the wire: encoding and checked decoding of the protobuf messages in proto/.

Every message a worker accepts from another peer is decoded here, with a size limit
checked before parsing; what is refused raises `WireRejected` with the reason, which the
caller logs and counts. (Signing and replay protection will wrap these bytes in a
SignedEnvelope here, without changing the callers.)
"""

from __future__ import annotations

import math
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from .errors import WireRejected
from .proto_gen import swarm_pb2

__all__ = ["MAX_RECORD_BYTES", "decode", "encode", "swarm_pb2"]

MAX_RECORD_BYTES = 64 * 1024
M = TypeVar("M", bound=Message)


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
