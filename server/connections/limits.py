"""What keeps connections that never send a request from taking the server's file descriptors:
a cap on open connections per client address, a deadline for a request's headers, and a cap on
all connections (below the process's descriptor limit, raised to its hard limit at start).

uvicorn has no header read timeout, and accepts every connection it is offered; this is its h11
protocol with those three rules added (`uvicorn.run(..., http=guarded_protocol(guard))`). A
connection over a cap is dropped at once, before anything is read or logged. When every slot is
taken, the connection that has waited longest without sending its headers makes room for the new
one: a flood of idle connections cannot lock out a client that sends a request.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("artisan.connections")
# asyncio accepts up to the listen backlog's worth of connections in one go, before any of them
# reaches the protocol, and a connection dropped to make room lets go of its descriptor one loop
# turn later: the cap leaves three backlogs of descriptors free, and more for what is not a
# connection (the store, checkpoints, logs, the model's files).
BACKLOG = 1024
RESERVED_FDS = 3 * BACKLOG + 512


def raise_fd_limit() -> int:
    """Raise this process's descriptor limit to its hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def connection_cap(fd_limit: int) -> int:
    return max(64, fd_limit - RESERVED_FDS)


class ConnectionGuard:
    """Open connections, per address and in all, and those still waiting to send their headers
    (oldest first). One event loop uses it: no lock."""

    def __init__(self, per_ip: int, header_timeout: float, max_connections: int):
        self.per_ip, self.header_timeout, self.max_connections = per_ip, header_timeout, max_connections
        self.per_address: Counter[str] = Counter()
        self.total = 0
        self.waiting: dict[Any, None] = {}  # protocols waiting for headers, in the order they started waiting
        self.dropped = Counter()  # why connections were closed: per_ip, full, header_timeout

    def admit(self, address: str) -> bool:
        """Count a new connection in, or say it must be dropped."""
        if self.per_address[address] >= self.per_ip:
            self.dropped["per_ip"] += 1
            return False
        if self.total >= self.max_connections:
            if not self.waiting:
                self.dropped["full"] += 1
                return False
            oldest = next(iter(self.waiting))
            self.dropped["full"] += 1
            oldest.drop()
        self.per_address[address] += 1
        self.total += 1
        return True

    def leave(self, address: str) -> None:
        self.total -= 1
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _address: str | None = None
        _timer: asyncio.TimerHandle | None = None
        _waiting_for: Any = None  # the request cycle current when the wait for headers began

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if not guard.admit(address):
                transport.abort()  # nothing read, nothing logged: the cheapest answer to a flood
                return
            self._address = address
            super().connection_made(transport)
            self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._address is None:
                return  # dropped in connection_made: never counted
            self._stop_waiting()
            guard.leave(self._address)
            self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._timer is None and (self.cycle is None or self.cycle.response_complete):
                self._wait_for_headers()  # a new request begins: its headers have a deadline too
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._waiting_for:
                self._stop_waiting()  # the request's headers are in: a new cycle started

        def drop(self) -> None:
            self._stop_waiting()
            self.transport.abort()

        def _wait_for_headers(self) -> None:
            self._waiting_for = self.cycle
            self._timer = self.loop.call_later(guard.header_timeout, self._headers_late)
            guard.waiting[self] = None

        def _stop_waiting(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            guard.waiting.pop(self, None)

        def _headers_late(self) -> None:
            self._timer = None
            guard.dropped["header_timeout"] += 1
            self.drop()

    return GuardedH11Protocol
