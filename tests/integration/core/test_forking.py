"""The at-fork registry (moescope/core/forking.py), in real forked children: what joined is reset
there, in order (modules first, then objects as they joined), held weakly, and one reset that
raises stops none of the others."""

from __future__ import annotations

import gc
import logging
import os
import sys
import weakref

import pytest

from moescope.core import forking
from tests.support.forked import in_forked_child

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX")

# What this module's components reset, in the order they did it: filled in a forked child only.
RESETS: list[str] = []


class Component:
    """Resets its own state (a counter of the parent's) and says so in RESETS."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self.state = ["the parent's"]

    def reset_in_child(self) -> None:
        self.state = []
        self.pid = os.getpid()
        RESETS.append(self.name)


class Broken(Component):
    def reset_in_child(self) -> None:
        RESETS.append(self.name)
        raise RuntimeError("this component cannot reset")


def _module_reset() -> None:
    RESETS.append("module")


def _ours() -> list[str]:
    return list(RESETS)


def test_a_forked_child_resets_modules_then_objects_in_the_order_they_joined():
    forking.join_module(_module_reset)
    forking.join_module(_module_reset)  # idempotent: it runs once per fork
    first, second, third = Component("first"), Component("second"), Component("third")
    for component in (second, first, third):  # join order, not creation order
        forking.join(component)

    def child() -> dict:
        return {"resets": _ours(), "state": [c.state for c in (first, second, third)],
                "pids": [c.pid for c in (first, second, third)], "pid": os.getpid()}

    seen = in_forked_child(child)
    assert seen["resets"] == ["module", "second", "first", "third"]
    assert seen["state"] == [[], [], []] and seen["pids"] == [seen["pid"]] * 3
    # the parent's own state is untouched, and nothing was reset here
    assert RESETS == [] and first.state == ["the parent's"] and first.pid == os.getpid() != seen["pid"]
    members = forking.members()
    assert members.index(_module_reset) < members.index(second) < members.index(first) < members.index(third)
    assert members.count(_module_reset) == 1


def test_the_registry_holds_objects_weakly():
    kept, dropped = Component("kept"), Component("dropped")
    forking.join(kept)
    forking.join(dropped)
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None  # the registry did not keep it alive
    assert any(m is kept for m in forking.members())
    assert not any(isinstance(m, Component) and m.name == "dropped" for m in forking.members())
    assert in_forked_child(lambda: [name for name in _ours() if name in ("kept", "dropped")]) == ["kept"]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_reset_that_raises_stops_none_of_the_others():
    before, broken, after = Component("before"), Broken("broken"), Component("after")
    for component in (before, broken, after):
        forking.join(component)
    logged = Lines()  # the child inherits it: what the registry logged there comes back with the result
    logger = logging.getLogger("moescope.core.forking")
    logger.addHandler(logged)
    try:
        seen = in_forked_child(lambda: {"resets": [n for n in _ours() if n in ("before", "broken", "after")],
                                        "after": after.state, "logged": logged.lines})
    finally:
        logger.removeHandler(logged)
    assert seen["resets"] == ["before", "broken", "after"] and seen["after"] == []  # the child came up whole
    assert len(seen["logged"]) == 1 and "could not start afresh" in seen["logged"][0]


def test_joining_needs_a_reset_of_its_own():
    with pytest.raises(TypeError, match="reset_in_child"):
        forking.join(object())  # type: ignore[arg-type]
