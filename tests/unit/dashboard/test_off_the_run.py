"""What the dashboard computes off a page's run (`moescope.dashboard.data.off_the_run`): each question
once, and a newer question of a function in place of the one of it still waiting in the queue."""

from __future__ import annotations

import threading

from moescope.dashboard import data

calls: list[tuple[str, int]] = []


def square(x: int) -> int:
    calls.append(("square", x))
    return x * x


def cube(x: int) -> int:
    calls.append(("cube", x))
    return x ** 3


def test_a_newer_question_replaces_the_queued_one_of_its_function():
    gate = threading.Event()

    def hold() -> None:  # the server's one worker busy: what is asked next waits in the queue
        gate.wait(60)

    data.off_the_run(hold)
    try:
        first = data.off_the_run(square, 3)
        assert data.off_the_run(square, 3) is first  # asked twice, computed once
        second = data.off_the_run(square, 4)
        other = data.off_the_run(cube, 2)
        assert first.cancelled() and not second.done() and not other.cancelled()
    finally:
        gate.set()
    assert second.result(timeout=60) == 16 and other.result(timeout=60) == 8
    again = data.off_the_run(square, 3)  # the cancelled question, asked again: computed now
    assert again is not first and again.result(timeout=60) == 9
    assert calls == [("square", 4), ("cube", 2), ("square", 3)]
    assert data.off_the_run_wait(timeout=60) and not data.off_the_run_pending()
