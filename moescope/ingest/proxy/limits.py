"""What the proxy listens on, what it forwards to, and what one client or a slow engine may hold of it.

Bounds (`ProxyLimits`; each is a flag of `moescope proxy`): at most `max_connections` client
connections; when they are all taken the one idle longest is hung up to make room, and with none
idle new clients wait in the listen backlog until one is free (a request in flight is never cut
off). A kept-alive connection is closed after `idle_timeout_s` without a request, a request
whose line and headers take longer than `header_timeout_s` in all is dropped, and the client must
send each piece of a body and take each piece of a response within `read_timeout_s`; the engine
must answer within `upstream_timeout_s` per read. Request bodies are streamed to the engine (one of
up to `BUFFERED_BODY_BYTES` is read whole first). Responses waiting to be recorded hold at most
`max_queue_bytes` in the queue plus as much again being captured; a response larger than
`MAX_CAPTURE_BYTES` is forwarded but not recorded.

The upstream is http://[USER:PASSWORD@]HOST[:PORT][/PATH]: credentials in it are sent as
`Authorization: Basic` (replacing any the client sent) and never printed, logged or returned;
`Upstream.url` is the URL without them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

__all__ = ["BUFFERED_BODY_BYTES", "DEFAULT_MAX_QUEUE_BYTES", "LISTEN_BACKLOG", "MAX_CAPTURE_BYTES", "READ_CHUNK",
           "ProxyLimits", "Upstream", "parse_listen", "parse_upstream"]

MAX_CAPTURE_BYTES = 64 * 1024 * 1024  # a response larger than this is forwarded but not recorded
READ_CHUNK = 64 * 1024
# A request body up to this size is read whole before it is sent, so a kept-alive engine connection
# that turns out closed can be retried on a new one; a larger body (or a chunked one) is streamed.
BUFFERED_BODY_BYTES = 1024 * 1024
# Connections the kernel holds for the proxy while its loop is busy (Linux caps it at somaxconn);
# http.server's default of 5 made a burst of clients wait a second or more for a SYN retry.
LISTEN_BACKLOG = 1024
DEFAULT_MAX_QUEUE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ProxyLimits:
    """What one client or a slow engine may hold of the proxy (see the module doc).

    Raises:
        ValueError: a value that is not a positive finite number; the message names the command's flag.
    """

    max_connections: int = 256
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    upstream_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name, flag in (("max_connections", "--max-connections"), ("idle_timeout_s", "--idle-timeout"),
                           ("header_timeout_s", "--header-timeout"), ("read_timeout_s", "--read-timeout"),
                           ("upstream_timeout_s", "--upstream-timeout")):
            value = getattr(self, name)
            if not (0 < value < float("inf")):
                raise ValueError(f"{flag} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class Upstream:
    """The engine the proxy forwards to, from `--upstream`; `url` never holds the credentials."""

    url: str
    hostname: str
    port: int
    host_header: str
    path: str
    authorization: str | None = field(default=None, repr=False)


def parse_upstream(text: str) -> Upstream:
    """Read `--upstream`: http://[USER:PASSWORD@]HOST[:PORT][/PATH].

    Args:
        text: the engine's base URL, credentials optional (percent-encoded).

    Returns:
        The `Upstream`; its `authorization` is an `Authorization: Basic` value made of the
        percent-decoded credentials, and its `url` leaves them out.

    Raises:
        ValueError: not http://, no host, a bad port, a query or a fragment; the message never
            holds the password.
    """
    parts = urlsplit(text.strip())
    userinfo, at, hostport = parts.netloc.rpartition("@")
    shown = f"{parts.scheme}://{'***@' if at else ''}{hostport}{parts.path}"
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"--upstream {shown!r}: the port must be a number from 1 to 65535") from None
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--upstream {shown!r}: give the engine's base URL as http://HOST:PORT")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream {shown!r}: give the base URL without a query or fragment")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host_header = f"{host}:{port}" if port else host
    authorization = None
    if at:
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
        authorization = f"Basic {token}"
    path = parts.path.rstrip("/")
    return Upstream(url=f"http://{host_header}{path}", hostname=parts.hostname, port=port or 80,
                    host_header=host_header, path=path, authorization=authorization)


def parse_listen(listen: str) -> tuple[str, int]:
    """Read `--listen`: 'HOST:PORT', or ':PORT' meaning 127.0.0.1.

    Returns:
        (host, port), the host without IPv6 brackets.

    Raises:
        ValueError: no port, or one outside 0-65535.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {listen!r}: write it as HOST:PORT, e.g. 127.0.0.1:8100")
    return host.strip("[]") or "127.0.0.1", int(port)
