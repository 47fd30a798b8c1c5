"""One at-fork registry: what a forked child must start afresh, each component resetting its own state.

A process that forks (a DataLoader worker, a server's pre-fork model, multiprocessing's fork start
method) hands its child copies of every lock, queue and thread-owned object, but not the threads.
Components that hold such state join this registry and reset only their own state in the child:

    forking.join(self)              # an object: its `reset_in_child()` runs in every forked child
    forking.join_module(_reset)     # a module's globals: the function runs in every forked child

This module registers the one `os.register_at_fork` hook; nothing else in moescope does. Objects are
held weakly (a closed session or a collected writer is not kept alive by the registry). In the child,
module resets run first, then objects', each in the order they joined; a reset that raises is
logged and the others still run: the child must come up, whatever one component could not reset.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["ForkSafe", "join", "join_module", "members"]

log = logging.getLogger(__name__)


@runtime_checkable
class ForkSafe(Protocol):
    """A component that knows how to start afresh in a forked child, touching only its own state."""

    def reset_in_child(self) -> None: ...


_LOCK = threading.Lock()
_MODULES: list[Callable[[], None]] = []
_OBJECTS: dict[int, weakref.ref[ForkSafe]] = {}  # insertion order is join order
_NEXT = 0


def join(component: ForkSafe) -> None:
    """Have `component.reset_in_child()` run in every child forked from now on, while it lives.

    Raises TypeError for an object without `reset_in_child`.
    """
    global _NEXT
    if not isinstance(component, ForkSafe):
        raise TypeError(f"{type(component).__name__} has no reset_in_child(): it cannot join the at-fork registry")
    with _LOCK:
        key = _NEXT
        _NEXT += 1
        _OBJECTS[key] = weakref.ref(component, functools.partial(_forget, key))


def _forget(key: int, _collected: object) -> None:
    """A joined object was collected: its entry goes (a weakref callback)."""
    _OBJECTS.pop(key, None)


def join_module(reset: Callable[[], None]) -> None:
    """Have `reset()` (a module resetting its own globals) run in every forked child; idempotent."""
    with _LOCK:
        if reset not in _MODULES:
            _MODULES.append(reset)


def members() -> list[object]:
    """What a child forked now would reset, in order: module resets, then live objects."""
    with _LOCK:
        return [*_MODULES, *_live_objects()]


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # a parent's thread may have held it at the fork
    resets = list(_MODULES) + [component.reset_in_child for component in _live_objects()]
    for reset in resets:
        try:
            reset()
        except Exception:
            log.exception("moescope: %r could not start afresh in a forked child", reset)


def _live_objects() -> list[ForkSafe]:
    objects = [ref() for ref in list(_OBJECTS.values())]
    return [o for o in objects if o is not None]


os.register_at_fork(after_in_child=_after_fork_in_child)
