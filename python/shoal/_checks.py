"""Argument checks of the Python layer, so that a value the native layer cannot hold (a
negative count, a size past 64 bits) is told as an InvalidArgumentError naming the argument,
not as the binding's "incompatible function arguments"."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional

from . import _shoal


UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "no uid": no process runs as it


def whole_number(where: str, name: str, value: Any, *, most: int = (1 << 64) - 1, least: int = 0,
                 allow_none: bool = False) -> None:
    """Raises InvalidArgumentError unless `value` is a whole number (an int, or anything with
    __index__ such as numpy's integers; not a bool) from `least` to `most` (or None when
    `allow_none`)."""
    if value is None and allow_none:
        return
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None or not least <= number <= most:
        # An int past 64 bits is named by its size: Python prints none of more than 4300 digits.
        said = f"a number of {number.bit_length()} bits" if number is not None and number.bit_length() > 64 else repr(value)
        raise _shoal.InvalidArgumentError(f"{where}: {name} must be a whole number from {least} to {most}, not {said}")


def timeout_seconds(where: str, timeout: Any) -> Optional[float]:
    """`timeout` as seconds when it is None or a finite number >= 0 (an int, a float, or
    numpy's; not a bool); TypeError for anything else that is no number, InvalidArgumentError
    for a number that is no wait."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{where}: timeout must be a number of seconds or None, not {type(timeout).__name__}")
    seconds = float(timeout)
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise _shoal.InvalidArgumentError(f"{where}: timeout must be a finite number of seconds >= 0, not {timeout!r}")
    return seconds


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
