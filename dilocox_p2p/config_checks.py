"""Checks of configuration values: each failure is a ConfigError naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal

from .errors import ConfigError

__all__ = ["check_choices", "check_maddr", "coerce", "fail"]


def fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ConfigError(f"{key} = {value!r}: {why}")


def check_choices(section: Any, name: str) -> None:
    """Reject values outside a field's Literal choices (also for sections built in code)."""
    for field, choices in _choices(type(section)):
        if getattr(section, field) not in choices:
            fail(f"{name}.{field}", getattr(section, field), f"must be one of: {', '.join(map(str, choices))}")


@functools.cache
def _choices(cls: type) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """The Literal fields of a config section and their choices, read once per class (resolving the type hints
    costs about 1 ms a field, and sections are also built in hot paths, e.g. a reducer's encoding config)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, typing.get_args(hints[f.name])) for f in dataclasses.fields(cls)
                 if typing.get_origin(hints[f.name]) is Literal)  # fmt: skip


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
