"""The bounds the server keeps across connections: the bytes of responses being captured, and the
deadline by which a request's headers must be whole.

Each connection's thread enforces its own timeouts with socket timeouts; these are what no one
thread can see: a budget all captures share, and a clock that hangs up a connection whose client
sends a byte now and then to stay under every per-read timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

__all__ = ["CaptureBudget", "Deadlines", "hang_up"]


class CaptureBudget:
    """Bytes of response bodies being captured, across every connection: at most `limit`."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (nothing reserved) when that would pass the limit."""
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        """Return `n` bytes reserved earlier."""
        with self._lock:
            self.used -= n


class Deadlines:
    """One thread that hangs up connections past a deadline (a request's headers must be whole by
    then): a socket timeout bounds each read, this bounds them all together, so a client sending a
    byte now and then cannot hold a connection. It looks every `tick_s` rather than being woken
    per request (a wake-up per request cost a context switch on the hot path); a deadline is kept
    to within that tick."""

    def __init__(self, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="moescope-proxy-deadlines", daemon=True).start()

    def arm(self, sock: socket.socket, at: float) -> None:
        """Hang `sock` up at `at` (time.monotonic()) unless it is disarmed first."""
        with self._lock:
            self._due[sock] = at

    def disarm(self, sock: socket.socket) -> None:
        """After this returns the socket is not hung up by this object."""
        with self._lock:
            self._due.pop(sock, None)

    def close(self) -> None:
        """Stop the thread (within a tick); deadlines still armed are not kept."""
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                for sock, at in list(self._due.items()):
                    if at <= now:
                        del self._due[sock]
                        hang_up(sock)


def hang_up(sock: socket.socket) -> None:
    """End a connection another thread is serving: its blocked read returns end-of-file and that
    thread closes the socket (closing it here could free a descriptor it is still using)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
