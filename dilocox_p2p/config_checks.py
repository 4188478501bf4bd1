"""Checks of configuration values: each failure is a ConfigError naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from .errors import ConfigError

__all__ = ["check_choices", "check_maddr", "coerce", "fail"]


def fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ConfigError(f"{key} = {value!r}: {why}")


def check_choices(section: Any, name: str) -> None:
    """Reject values outside a field's Literal choices (also for sections built in code)."""
    for f in dataclasses.fields(section):
        hint = typing.get_type_hints(type(section))[f.name]
        if typing.get_origin(hint) is Literal and getattr(section, f.name) not in typing.get_args(hint):
            choices = ", ".join(map(str, typing.get_args(hint)))
            fail(f"{name}.{f.name}", getattr(section, f.name), f"must be one of: {choices}")


def check_maddr(key: str, text: str, *, need_peer_id: bool) -> None:
    import multiaddr

    try:
        protocols = [p.name for p in multiaddr.Multiaddr(text).protocols()]
    except Exception as e:  # the multiaddr package raises several types
        fail(key, text, f"not a multiaddr ({e}); expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...")
    if need_peer_id and "p2p" not in protocols:
        fail(key, text, "lacks the peer id: copy the whole address, ending in /p2p/<peer id>, from multiaddrs.txt")


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "a table"}


def coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(map(str, typing.get_args(hint)))
            fail(key, value, f"must be one of: {choices}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            fail(key, value, "must be a list of strings")
        return tuple(value)
    if origin in (typing.Union, types.UnionType):  # pragma: no cover - no optional fields today
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        fail(key, value, f"must be {_KIND[hint]}, got {_KIND.get(type(value), type(value).__name__)}")
    return value
