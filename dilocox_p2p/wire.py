"""Bytes on the wire: encoding and checked decoding of the protobuf messages in proto/.

Every message a worker accepts from another peer is decoded here, with a size limit and
a logged reason when it is refused. (Signing and replay protection will wrap these bytes
in a SignedEnvelope here, without changing the callers.)
"""

from __future__ import annotations

import logging
import math
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from .proto_gen import swarm_pb2

__all__ = ["MAX_RECORD_BYTES", "decode", "encode", "swarm_pb2"]

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 * 1024
M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    return message.SerializeToString()


def decode(cls: type[M], blob: object, *, max_bytes: int = MAX_RECORD_BYTES, source: str = "peer") -> M | None:
    """Parse `blob` as `cls`; None (with a debug log of why) if it is not acceptable."""
    if not isinstance(blob, bytes):
        logger.debug("refused %s from %s: expected bytes, got %s", cls.__name__, source, type(blob).__name__)
        return None
    if len(blob) > max_bytes:
        logger.debug("refused %s from %s: %d bytes > limit %d", cls.__name__, source, len(blob), max_bytes)
        return None
    message = cls()
    try:
        message.ParseFromString(blob)
    except DecodeError as e:
        logger.debug("refused %s from %s: malformed (%s)", cls.__name__, source, e)
        return None
    for field, value in message.ListFields():
        if isinstance(value, float) and not math.isfinite(value):
            logger.debug("refused %s from %s: non-finite %s", cls.__name__, source, field.name)
            return None
    return message
