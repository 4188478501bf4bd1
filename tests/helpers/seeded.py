"""Seeded cases for the fuzz tests whose inputs are alterations of a valid message (tests/unit/test_fuzz_*.py).

An alteration needs no search strategy: each case is drawn with `random.Random` from a fixed seed, so the same
cases run every time, and a case costs only the work of the code under test. Drawn by hypothesis, the same case
cost about 3 ms more on a 2-core CI machine (its per-example bookkeeping, including saving and restoring the global
random states), most of these tests' time. Hypothesis stays where the input's structure is searched (protobuf-like
bytes, envelopes of any field values, reframed messages). A failing case is named with its index, seed and value.

Bytes shaped like protobuf messages are drawn the same way (`protobuf_like`, `peer_bytes`); a hypothesis
strategy that needs them draws a seed and maps it through (tests/unit/test_fuzz_decoders.py).

Positions are shares of a length, so they land anywhere in a message of any size; one draw in four takes an end
(the first byte, the last, or past the last), where off-by-one mistakes live.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from typing import TypeVar

__all__ = ["byte_edits", "check_each", "mutate", "peer_bytes", "position", "protobuf_like", "varint"]

T = TypeVar("T")


def check_each(n: int, draw: Callable[[random.Random], T], check: Callable[[T], None], *, seed: int) -> int:
    """Run `check` on `n` cases drawn by `draw` from `seed`; a failure names its case. Returns `n`."""
    rng = random.Random(seed)
    for i in range(n):
        case = draw(rng)
        try:
            check(case)
        except BaseException as e:
            e.add_note(f"seeded case {i} of {n} (seed {seed}): {case!r}")
            raise
    return n


def position(rng: random.Random, *, end: bool = False) -> float:
    """A share of a length in [0, 1) ([0, 1] with `end`: past the last byte), an end one time in four."""
    roll = rng.random()
    if roll < 0.125:
        return 0.0
    if roll < 0.25:
        return 1.0 if end else 0.999999
    return rng.random()


def byte_edits(rng: random.Random, *, most: int = 4) -> list[tuple]:
    """1 to `most` edits of a byte string, for `mutate`: a bit flipped, a byte set, bytes inserted or deleted, the
    rest cut off."""
    ops: list[tuple] = []
    for _ in range(rng.randint(1, most)):
        kind = rng.choice(("flip", "truncate", "insert", "delete", "set"))
        if kind == "flip":
            ops.append((kind, position(rng), rng.randrange(8)))
        elif kind == "truncate":
            ops.append((kind, position(rng)))
        elif kind == "insert":
            ops.append((kind, position(rng, end=True), rng.randbytes(rng.randint(1, 12))))
        elif kind == "delete":
            ops.append((kind, position(rng), rng.randint(1, 12)))
        else:
            ops.append((kind, position(rng), rng.choice((0, 255, rng.randrange(256)))))
    return ops


def mutate(blob: bytes, ops: list[tuple]) -> bytes:
    """`blob` with `ops` (as `byte_edits` draws them) made in turn."""
    out = bytearray(blob)
    for kind, where, *arg in ops:
        at = int(where * len(out))
        if kind == "insert":
            out[at:at] = arg[0]
        elif not out:
            continue
        elif kind == "flip":
            out[at] ^= 1 << arg[0]
        elif kind == "truncate":
            del out[at:]
        elif kind == "delete":
            del out[at : at + arg[0]]
        else:
            out[at] = arg[0]
    return bytes(out)


# ----- bytes shaped like protobuf messages ---------------------------------------------------------------------
_SPECIAL_FLOATS = (0.0, -0.0, 1.0, float("nan"), float("inf"), float("-inf"), 5e-324, 1.7976931348623157e308, 3.4e38)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    return varint(number << 3 | wire_type) + body


def _fixed(rng: random.Random, fmt: str) -> bytes:
    """A float of `fmt` ("<d" or "<f"): a special value (NaN, infinities, -0, extremes) or any bit pattern."""
    if rng.random() < 0.5:
        value = rng.choice(_SPECIAL_FLOATS)
        return struct.pack(fmt, value if fmt == "<d" or not math.isfinite(value) or abs(value) <= 3.4e38 else 3.4e38)
    return rng.randbytes(struct.calcsize(fmt))


def _text(rng: random.Random) -> bytes:
    """UTF-8 of up to 20 characters, ASCII or any code point outside the surrogates."""
    points = (rng.randint(32, 126) if rng.random() < 0.7 else rng.choice((rng.randint(0x80, 0xD7FF),
              rng.randint(0xE000, 0x10FFFF))) for _ in range(rng.randint(0, 20)))  # fmt: skip
    return "".join(map(chr, points)).encode()


def _field_like(rng: random.Random, depth: int) -> bytes:
    number, kind = rng.randint(1, 12), rng.randrange(7)  # every field of every message here has a number <= 11
    if kind == 0:
        return _field(number, 0, varint(rng.choice((0, 1, 2**63, 2**64 - 1, rng.getrandbits(rng.choice((7, 32, 64)))))))
    if kind == 1:
        return _field(number, 1, _fixed(rng, "<d"))
    if kind == 2:
        return _field(number, 5, _fixed(rng, "<f"))
    if kind == 3:  # a length that tells the truth: bytes, text or a nested message
        body = rng.choice((rng.randbytes(rng.randint(0, 40)), _text(rng), protobuf_like(rng, depth - 1) if depth else b""))
        return _field(number, 2, varint(len(body)) + body)
    if kind == 4:  # a length that lies
        lie = rng.choice((1, 2**31, 2**40, rng.randint(0, 2**40)))
        return _field(number, 2, varint(lie) + rng.randbytes(rng.randint(0, 8)))
    if kind == 5:  # groups and wire types no message here uses
        return _field(number, rng.choice((3, 4, 6, 7)), rng.randbytes(rng.randint(0, 8)))
    return rng.randbytes(rng.randint(1, 6))  # noise between fields


def protobuf_like(rng: random.Random, depth: int = 2) -> bytes:
    """Bytes shaped like a protobuf message (nested ones too, `depth` deep), with the odd lie in them: up to 6
    fields of every wire type, lengths true and false, special floats, and noise between them."""
    return b"".join(_field_like(rng, depth) for _ in range(rng.randint(0, 6)))


def peer_bytes(rng: random.Random) -> bytes:
    """What a peer may send where a message is expected: any bytes (up to 300), or protobuf-shaped ones."""
    return rng.randbytes(rng.randint(0, 300)) if rng.random() < 0.5 else protobuf_like(rng)
