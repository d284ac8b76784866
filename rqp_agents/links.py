"""The sending MCA's TCP connections to receiving MCAs, one per host at most.

They only move bytes: a connect (bounded by ``connect_timeout``, with ``TCP_NODELAY``; over
TLS the handshake is within that bound too), the frames to write, a close; the bytes that
arrive and the ends of connections are handed to the sending MCA, which gives them to its
core. A connection that was replaced or closed says nothing more. A TLS failure is reported
in words (:func:`rqp.system.tls.handshake_problem`), never as an errno.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
from collections.abc import Callable

from rqp.system.tls import ALPN, CLOSED_IN_HANDSHAKE, ERRNO_OF, handshake_problem

__all__ = ["Links", "keepalive"]


class _Link(asyncio.Protocol):
    def __init__(self, links: "Links", host) -> None:
        self.links = links
        self.host = host
        self.transport: asyncio.Transport | None = None
        #: Set when the connection ended, with its exception (None: closed in order).
        self.ended = False
        self.end: BaseException | None = None
        self.tls = False
        self.heard = False  # a byte came from the receiver

    def connection_made(self, transport) -> None:
        self.transport = transport

    # asyncio drops an OSError raised here without a word: guard() stops the agent instead.
    def data_received(self, data: bytes) -> None:
        self.heard = True
        self.links.guard(f"the connection to {self.host}", self.links._data, self, data)

    def eof_received(self):
        self.links.guard(f"the connection to {self.host}", self.links._data, self, b"")
        return False

    def connection_lost(self, exc) -> None:
        self.ended, self.end = True, exc
        self.links.guard(f"the connection to {self.host}", self.links._lost, self, exc)


class Links:
    """``on_connected(host)``, ``on_failed(host, why)``, ``on_data(host, data)`` (``b""``: the
    peer ended the stream) and ``on_lost(host, why, clean)`` (clean: the peer closed it in
    order) are called on the loop; ``guard(where, fn, *args)`` runs a callback so that an
    unexpected error stops the agent; ``tls_for(host)`` is the TLS context to dial ``host``
    with (None: plaintext)."""

    def __init__(self, *, on_connected: Callable, on_failed: Callable, on_data: Callable,
                 on_lost: Callable, guard: Callable,
                 tls_for: Callable[[object], ssl.SSLContext | None] = lambda host: None) -> None:
        self.on_connected, self.on_failed = on_connected, on_failed
        self.on_data, self.on_lost, self.guard = on_data, on_lost, guard
        self.tls_for = tls_for
        self._links: dict[object, _Link] = {}

    def __iter__(self):
        return iter(list(self._links))

    async def connect(self, host, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        context = self.tls_for(host)
        tls = {} if context is None else {"ssl": context, "server_hostname": host.host,
                                          "ssl_handshake_timeout": timeout}
        try:
            _, link = await asyncio.wait_for(
                loop.create_connection(lambda: _Link(self, host), host.host, host.port, **tls),
                timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            why = _failure(exc)
            if context is not None and isinstance(exc, ConnectionError) and not isinstance(
                    exc, ConnectionRefusedError):  # (connected: cut off in the handshake; a
                why = f"TLS handshake failed: {why}{CLOSED_IN_HANDSHAKE}"  # trial's said only
                # "cannot connect: Connection reset by peer")
            elif context is not None and isinstance(exc, asyncio.TimeoutError):
                why = "timed out (connecting, or in the TLS handshake)"  # (a trial's listener
            self.on_failed(host, why)  # that took the connection and never spoke TLS)
            return
        link.tls = context is not None
        if link.ended:  # e.g. the receiver refused this host's certificate (TLS 1.3), or was
            # at its max_connections (a trial's log said "cannot connect: closed")
            self.on_failed(host, _failure(link.end) if link.end else _CLOSED_AT_ONCE)
            return
        if context is not None and not link.transport.is_closing():
            ssl_object = link.transport.get_extra_info("ssl_object")
            alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
            if alpn != ALPN:
                link.transport.abort()
                self.on_failed(host, f"TLS: the receiver did not negotiate ALPN {ALPN} "
                                     f"(it chose {alpn or 'none'})")
                return
        sock = link.transport.get_extra_info("socket")
        if sock is not None:  # (None once the transport is closing: its end is reported)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
        self._links[host] = link
        self.on_connected(host)

    def write(self, host, frames: list[bytes]) -> None:
        link = self._links.get(host)
        if link is not None:
            link.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def close(self, host, *, reset: bool = False) -> None:
        """Abort the connection to ``host`` (nothing is reported for it). ``reset``: a
        connection given up with frames unanswered (a time-out, a failure, a stop) ends with
        a TCP reset, which drops what the kernel still holds to send: closed so, the kernel
        sent it on, and on a link that came back after a minute a trial's receiving MCA put
        UNSURE messages counted lost 108 s late, behind newer ones."""
        link = self._links.pop(host, None)
        if link is not None:
            if reset:
                _reset_on_close(link.transport)
            link.transport.abort()

    def close_all(self, *, reset: bool = False) -> None:
        for host in self:
            self.close(host, reset=reset)

    def _data(self, link: _Link, data: bytes) -> None:
        if self._links.get(link.host) is not link:
            return
        if not data and link.tls and not link.heard:  # refused after the handshake: say so
            del self._links[link.host]
            link.transport.abort()
            self.on_lost(link.host, REFUSED_AFTER_HANDSHAKE, False)
            return
        self.on_data(link.host, data)

    def _lost(self, link: _Link, exc) -> None:
        if self._links.get(link.host) is link:
            del self._links[link.host]
            self.on_lost(link.host, _ending(link), exc is None)


_CLOSED_AT_ONCE = ("the receiving MCA closed the connection at once (at its max_connections, or "
                   "refusing this host: its log says why)")

#: Over TLS 1.3 the receiver checks this host's certificate after the handshake is done on
#: this side, and a receiver that refuses it closes the connection (its alert may not arrive).
REFUSED_AFTER_HANDSHAKE = (
    "TLS: the receiver closed the connection before answering anything -- does it trust this "
    "host's certificate (its CA) and is the identity allowed? The receiver's log says why")


def _ending(link: _Link) -> str:
    """Why ``link`` ended, in words."""
    if link.tls and not link.heard and not isinstance(link.end, ssl.SSLError):
        return REFUSED_AFTER_HANDSHAKE
    return _failure(link.end) if link.end else "closed"


def _failure(exc: BaseException) -> str:
    """Why a connection failed or ended, in words."""
    if isinstance(exc, ssl.SSLError):  # (its errno is OpenSSL's, not the system's)
        return handshake_problem(exc)
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, socket.gaierror):  # (its errno is getaddrinfo's: os.strerror says
        return f"cannot resolve the host name: {exc.strerror or exc}"  # "Unknown error -3")
    # (asyncio's own text, "Connect call failed (addr)", hides the reason; asyncio's TLS
    # raises ConnectionResetError() with no errno and no text: a trial's log said "cannot
    # connect: " and nothing more)
    code = getattr(exc, "errno", None) or ERRNO_OF.get(type(exc))
    return os.strerror(code) if code else str(exc) or type(exc).__name__


#: TCP keepalive on every connection between the agents, both ends: after 60 s without
#: traffic the kernel probes every 10 s and gives up after 3 missed probes (the sending MCA's
#: heartbeats do the same at the RQP level; keepalive also covers a connection while the
#: sending MCA itself is stopped, and the receiving MCA's end).
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 10, 3


def _reset_on_close(transport: asyncio.Transport) -> None:
    """Make the close of ``transport``'s socket a reset (``SO_LINGER`` on, 0 s)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
        except OSError:  # (already closed under it: nothing left to drop)
            pass


#: ``struct linger`` {on, 0 s}: close() resets the connection, dropping unsent data.
LINGER_RESET = struct.pack("ii", 1, 0)


def keepalive(sock: socket.socket, unacknowledged: float | None = None) -> None:
    """TCP keepalive on ``sock``: a peer gone without a word (its host down, a reset lost on
    the way) is found within about a minute and a half of silence. Keepalive probes only a
    connection with nothing to send: ``unacknowledged`` (seconds) bounds how long data sent
    may stay unacknowledged, or the peer's window shut (``TCP_USER_TIMEOUT``; a re-check's
    receiver with answers unacknowledged kept a connection past 160 s of a dark link, for
    ``tcp_retries2``'s 15 minutes)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    options = [("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
               ("TCP_KEEPCNT", KEEPALIVE_COUNT)]
    if unacknowledged is not None:
        options.append(("TCP_USER_TIMEOUT", max(1, int(unacknowledged * 1000))))
    for option, value in options:
        if hasattr(socket, option):  # (Linux; elsewhere the system's defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
