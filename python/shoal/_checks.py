"""Argument checks of the Python layer, so that a value the native layer cannot hold (a
negative count, a size past 64 bits) is told as an InvalidArgumentError naming the argument,
and a value of the wrong type as a TypeError naming it, not as the binding's "incompatible
function arguments"."""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any, Optional, Union

from . import _shoal


UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "no uid": no process runs as it


def whole_number(where: str, name: str, value: Any, *, most: int = (1 << 64) - 1, least: int = 0,
                 allow_none: bool = False) -> None:
    """Raises TypeError unless `value` is a whole number (an int, or anything with __index__
    such as numpy's integers; not a bool) or None when `allow_none`, as the native layer does
    for a value of the wrong type; InvalidArgumentError unless it lies from `least` to `most`."""
    if value is None and allow_none:
        return
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None:
        none = " or None" if allow_none else ""
        raise TypeError(f"{where}: {name} must be a whole number from {least} to {most}{none}, not {value!r}")
    if not least <= number <= most:
        # An int past 64 bits is named by its size: Python prints none of more than 4300 digits.
        said = f"a number of {number.bit_length()} bits" if number.bit_length() > 64 else repr(value)
        raise _shoal.InvalidArgumentError(f"{where}: {name} must be a whole number from {least} to {most}, not {said}")


def real_number(where: str, name: str, value: Any, what: str, *, allow_none: bool = False) -> None:
    """Raises TypeError naming `name` unless `value` is a real number (an int, a float, or
    numpy's; not a bool), or None when `allow_none`; `what` says the number in the message
    ("a number of seconds"). Its range is the caller's to check."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        none = " or None" if allow_none else ""
        raise TypeError(f"{where}: {name} must be {what}{none}, not {type(value).__name__}")


def timeout_seconds(where: str, timeout: Any) -> Optional[float]:
    """`timeout` as seconds when it is None or a finite number >= 0 (an int, a float, or
    numpy's; not a bool); TypeError for anything else that is no number, InvalidArgumentError
    for a number that is no wait."""
    real_number(where, "timeout", timeout, "a number of seconds", allow_none=True)
    if timeout is None:
        return None
    seconds = float(timeout)
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise _shoal.InvalidArgumentError(f"{where}: timeout must be a finite number of seconds >= 0, not {timeout!r}")
    return seconds


def socket_address(where: str, address: Any) -> str:
    """`address` as the str the native layer takes: a str, or an os.PathLike naming a str path
    (a pathlib.Path); TypeError for anything else, bytes paths included."""
    path = os.fspath(address) if isinstance(address, os.PathLike) else address
    if not isinstance(path, str):
        said = "a bytes path" if isinstance(path, bytes) else type(address).__name__
        raise TypeError(f"{where}: address must be a str or a pathlib.Path (a socket path, or '@name'), not {said}")
    return path


def absolute_address(where: str, address: str) -> str:
    """`address` (socket_address's) unchanged, or an InvalidArgumentError naming `where` for a
    relative path, which the native layer refuses in its own words. Called just before the
    connection or listener is made, after the call's other arguments were checked."""
    if address and not address.startswith(("/", "@")):
        raise _shoal.InvalidArgumentError(
            f"{where}: the address {address!r} is a relative path; give an absolute one, so that both ends "
            "name the same file (shoal.runtime_dir_address(name) gives the recommended one), or '@name' for "
            "an abstract socket")
    return address


def uids(where: str, allowed_uids: Any) -> list[int]:
    """`allowed_uids` as the list of uids the native layer takes: any iterable of whole
    numbers from 0 to UID_MAX (a TypeError for one uid given alone, an InvalidArgumentError
    naming `where` for one out of range)."""
    if isinstance(allowed_uids, (str, bytes)) or not hasattr(allowed_uids, "__iter__"):
        raise TypeError(f"{where}: allowed_uids must be a sequence of uids (say [1000]), not "
                        f"{type(allowed_uids).__name__}")
    listed = list(allowed_uids)
    for uid in listed:
        whole_number(where, "allowed_uids", uid, most=UID_MAX)
    return [operator.index(uid) for uid in listed]


def cancel_event(where: str, cancel: Optional[Any]) -> None:
    """Raises TypeError unless `cancel` is None or has is_set() (a threading.Event)."""
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise TypeError(f"{where}: cancel must be a threading.Event (anything with is_set()) or None, not {cancel!r}")


def instance_of(where: str, name: str, value: Any, kind: Union[type, tuple[type, ...]], what: str, *,
                allow_none: bool = False, hint: str = "") -> None:
    """Raises TypeError naming `name` unless `value` is a `kind` (a type, or a tuple of types as
    isinstance takes) or None when `allow_none`; `what` says the kind in the message, `hint`
    may say how to get one."""
    if value is None and allow_none:
        return
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return
    none = " or None" if allow_none else ""
    raise TypeError(f"{where}: {name} must be {what}{none}, not {type(value).__name__}{hint}")


def torch_module(where: str) -> Any:
    """PyTorch, imported; without it a ModuleNotFoundError that names `where` and says that
    it needs PyTorch (rather than Python's bare "No module named 'torch'")."""
    try:
        import torch
    except ModuleNotFoundError as missing:
        if missing.name != "torch":
            raise  # PyTorch is there but broken: its own error says more
        raise ModuleNotFoundError(
            f"{where} needs PyTorch, which is not installed in this Python ({missing}); install torch "
            "(the CUDA build for GPU work), or use shoal's own storages, which need no PyTorch",
            name="torch") from None
    return torch
