"""What a fork() child of a process that used shoal makes anew.

Only the forking thread comes along into the child: a lock another of the
parent's threads held at the fork is never let go there, and a child that
took it would wait for good.
"""

from __future__ import annotations

import os
import sys
import threading


def renew_lock_in_fork_child(module: str, name: str) -> None:
    """In every fork() child, module `module`'s global `name` becomes a new
    threading.Lock. Its users must read the global at each use (not import it
    by name)."""
    os.register_at_fork(after_in_child=lambda: setattr(sys.modules[module], name, threading.Lock()))
