"""The sending MCA's TCP connections to receiving MCAs, one per host at most.

They only move bytes: a connect (bounded by ``connect_timeout``, with ``TCP_NODELAY``), the
frames to write, a close; the bytes that arrive and the ends of connections are handed to
the sending MCA, which gives them to its core. A connection that was replaced or closed says
nothing more.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

__all__ = ["Links"]


class _Link(asyncio.Protocol):
    def __init__(self, links: "Links", host) -> None:
        self.links = links
        self.host = host
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    # asyncio drops an OSError raised here without a word: guard() stops the agent instead.
    def data_received(self, data: bytes) -> None:
        self.links.guard(f"the connection to {self.host}", self.links._data, self, data)

    def eof_received(self):
        self.links.guard(f"the connection to {self.host}", self.links._data, self, b"")
        return False

    def connection_lost(self, exc) -> None:
        self.links.guard(f"the connection to {self.host}", self.links._lost, self, exc)


class Links:
    """``on_connected(host)``, ``on_failed(host, why)``, ``on_data(host, data)`` (``b""``: the
    peer ended the stream) and ``on_lost(host, why, clean)`` (clean: the peer closed it in
    order) are called on the loop; ``guard(where, fn, *args)`` runs a callback so that an
    unexpected error stops the agent."""

    def __init__(self, *, on_connected: Callable, on_failed: Callable, on_data: Callable,
                 on_lost: Callable, guard: Callable) -> None:
        self.on_connected, self.on_failed = on_connected, on_failed
        self.on_data, self.on_lost, self.guard = on_data, on_lost, guard
        self._links: dict[object, _Link] = {}

    def __iter__(self):
        return iter(list(self._links))

    async def connect(self, host, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, link = await asyncio.wait_for(
                loop.create_connection(lambda: _Link(self, host), host.host, host.port),
                timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            # (asyncio's own text, "Connect call failed (addr)", hides the reason)
            why = "timed out" if isinstance(exc, asyncio.TimeoutError) else (
                os.strerror(exc.errno) if exc.errno else str(exc))
            self.on_failed(host, why)
            return
        link.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._links[host] = link
        self.on_connected(host)

    def write(self, host, frames: list[bytes]) -> None:
        link = self._links.get(host)
        if link is not None:
            link.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def close(self, host) -> None:
        """Abort the connection to ``host`` (nothing is reported for it)."""
        link = self._links.pop(host, None)
        if link is not None:
            link.transport.abort()

    def close_all(self) -> None:
        for host in self:
            self.close(host)

    def _data(self, link: _Link, data: bytes) -> None:
        if self._links.get(link.host) is link:
            self.on_data(link.host, data)

    def _lost(self, link: _Link, exc) -> None:
        if self._links.get(link.host) is link:
            del self._links[link.host]
            self.on_lost(link.host, str(exc) if exc else "closed", exc is None)
