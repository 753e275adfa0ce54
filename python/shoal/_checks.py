"""Argument checks of the Python layer, so that a value the native layer cannot hold (a
negative count, a size past 64 bits) is told as an InvalidArgumentError naming the argument,
not as the binding's "incompatible function arguments"."""

from __future__ import annotations

from typing import Any, Optional

from . import _shoal


def whole_number(where: str, name: str, value: Any, *, bits: int = 64, least: int = 0,
                 allow_none: bool = False) -> None:
    """Raises InvalidArgumentError unless `value` is an int from `least` to 2**bits - 1 (or None
    when `allow_none`)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value < 1 << bits:
        raise _shoal.InvalidArgumentError(
            f"{where}: {name} must be a whole number from {least} to {(1 << bits) - 1}, not {value!r}")


def cancel_event(where: str, cancel: Optional[Any]) -> None:
    """Raises TypeError unless `cancel` is None or has is_set() (a threading.Event)."""
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise TypeError(f"{where}: cancel must be a threading.Event (anything with is_set()) or None, not {cancel!r}")


def instance_of(where: str, name: str, value: Any, kind: type, what: str, *, allow_none: bool = False,
                hint: str = "") -> None:
    """Raises TypeError naming `name` unless `value` is a `kind` (or None when `allow_none`);
    `what` says the kind in the message, `hint` may say how to get one."""
    if value is None and allow_none:
        return
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return
    none = " or None" if allow_none else ""
    raise TypeError(f"{where}: {name} must be {what}{none}, not {type(value).__name__}{hint}")
