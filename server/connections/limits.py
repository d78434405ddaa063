"""What keeps connections that never send a request from taking the server's file descriptors:
a cap on open connections per client address, a deadline for a request's headers, and a cap on
all connections (below the process's descriptor limit, raised to its hard limit at start). And
what keeps a burst of requests from one address, or from all, from being answered with a reset:
soft caps on requests in flight, well below the hard caps on connections.

uvicorn has no header read timeout, and accepts every connection it is offered; this is its h11
protocol with those rules added (`uvicorn.run(..., http=guarded_protocol(guard))`). A connection
over a hard cap is dropped at once, before anything is read or logged. When every slot is taken,
the connection that has waited longest without sending its headers makes room for the new one: a
flood of idle connections cannot lock out a client that sends a request. A request over a soft cap
never reaches the API: it is answered 503 with Retry-After and the API's error body, and its
connection closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from server.settings import Settings

log = logging.getLogger("artisan.connections")
# asyncio accepts up to the listen backlog's worth of connections in one go, before any of them
# reaches the protocol, and a connection dropped to make room lets go of its descriptor one loop
# turn later: the cap leaves three backlogs of descriptors free, and more for what is not a
# connection (the store, checkpoints, logs, the model's files).
BACKLOG = 1024
RESERVED_FDS = 3 * BACKLOG + 512
RETRY_AFTER_S = 1
# The API's error body, `error_body(status, message, code=...)` of server/api/errors.py: passed in by
# the entry point, which alone imports the HTTP face.
ErrorBody = Callable[..., dict]
# A request turned away is answered only once its body (this much of it, for this long) has been
# read and thrown away: a socket closed with bytes unread sends a reset, which can cost the client
# the answer it was sent.
DRAIN_BYTES = 64 * 1024
DRAIN_S = 1.0


def raise_fd_limit() -> int:
    """Raise this process's descriptor limit to its hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def connection_cap(fd_limit: int) -> int:
    return max(64, fd_limit - RESERVED_FDS)


class Tally:
    """A count per client address, and their sum."""

    def __init__(self) -> None:
        self.by_address: Counter[str] = Counter()
        self.total = 0

    def __getitem__(self, address: str) -> int:
        return self.by_address[address]

    def add(self, address: str) -> None:
        self.by_address[address] += 1
        self.total += 1

    def remove(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class ConnectionGuard:
    """Open connections, per address and in all, and those still waiting to send their headers
    (oldest first): the hard caps. Requests in flight, per address and in all: the soft caps. One
    event loop uses it: no lock."""

    def __init__(self, per_ip: int, header_timeout: float, max_connections: int, requests_per_ip: int,
                 max_requests: int):
        self.per_ip, self.header_timeout, self.max_connections = per_ip, header_timeout, max_connections
        self.requests_per_ip, self.max_requests = requests_per_ip, max_requests
        self.connections, self.requests = Tally(), Tally()
        self.waiting: dict[Any, None] = {}  # protocols waiting for headers, in the order they started waiting
        self.dropped = Counter()  # why connections were closed: per_ip, full, header_timeout
        self.shed = Counter()  # why requests were answered 503: per_ip, full

    def admit(self, address: str) -> bool:
        """Count a new connection in, or say it must be dropped."""
        if self.connections[address] >= self.per_ip:
            self.dropped["per_ip"] += 1
            return False
        if self.connections.total >= self.max_connections:
            if not self.waiting:
                self.dropped["full"] += 1
                return False
            oldest = next(iter(self.waiting))
            self.dropped["full"] += 1
            oldest.drop()
        self.connections.add(address)
        return True

    def leave(self, address: str) -> None:
        self.connections.remove(address)

    def start_request(self, address: str) -> str | None:
        """Count a request in, or say (to its client) why it is answered 503."""
        if self.requests[address] >= self.requests_per_ip:
            self.shed["per_ip"] += 1
            return f"{self.requests_per_ip} requests from this address are in flight (--max-requests-per-ip)"
        if self.requests.total >= self.max_requests:
            self.shed["full"] += 1
            return f"{self.max_requests} requests are in flight (--max-requests)"
        self.requests.add(address)
        return None

    def end_request(self, address: str) -> None:
        self.requests.remove(address)


def guard_of(settings: Settings, fd_limit: int) -> ConnectionGuard:
    max_connections = connection_cap(fd_limit)
    return ConnectionGuard(per_ip=settings.max_connections_per_ip, header_timeout=settings.header_timeout,
                           max_connections=max_connections, requests_per_ip=settings.max_requests_per_ip,
                           max_requests=settings.max_requests or max(1, max_connections // 4))


async def answer_overloaded(reason: str, error_body: ErrorBody, scope: dict, receive: Any, send: Any) -> None:
    """An ASGI answer to a request past a soft cap: 503, Retry-After and the API's error body (as
    the Messages paths shape it there), and the connection closed after it."""
    await _drain(scope, receive)
    error = error_body(503, f"server is at capacity: {reason}; retry after {RETRY_AFTER_S} s", code="overloaded")
    if scope["path"].endswith("/messages"):
        error = {"type": "error", **error}
    body = json.dumps(error, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(scope: dict, receive: Any) -> None:
    if any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"]):
        return  # its client sends the body only when asked to: it is not asked

    async def read() -> None:
        left = DRAIN_BYTES
        while left > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            left -= len(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), DRAIN_S)
    except TimeoutError:
        pass


def guarded_protocol(guard: ConnectionGuard, error_body: ErrorBody) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _address: str | None = None
        _timer: asyncio.TimerHandle | None = None
        _waiting_for: Any = None  # the request cycle current when the wait for headers began

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._api, self.app = self.app, self._soft_capped  # each request meets the soft caps first

        async def _soft_capped(self, scope: dict, receive: Any, send: Any) -> None:
            address = self._address
            if address is None:
                return  # the connection is gone already: no one to answer
            over = guard.start_request(address)
            if over is not None:
                log.warning("%s: answered 503: %s", address, over)
                await answer_overloaded(over, error_body, scope, receive, send)
                return
            try:
                await self._api(scope, receive, send)
            finally:
                guard.end_request(address)

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
