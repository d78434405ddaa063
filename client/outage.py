"""Rollouts and evaluations wait out a server restart, as training calls do (client/model.py).

A rollout's model calls retry a few seconds (rollouts/agent.py); a restart takes 20-140 s. A
rollout that still fails for want of a connection is not the agent's failure and must not count
as one (DESIGN.md, invariant 4): when the server does not answer its health check either, the
rollout waits until it does and runs again from its start. All the rollouts that fail in one
outage wait on one health check, said once on stderr; the wait is bounded by the model's retry
window, after which the run stops with ServerUnreachable. A failure while the server answers is
the rollout's own (a tool backend, a bad reply): an exception of its group, as before.
"""

from __future__ import annotations

import asyncio
import sys
import time
import weakref
from typing import Any, Awaitable, Callable, TypeVar

import httpx
import openai

from client.errors import ServerUnreachable
from protocol.retry import RetryPolicy

T = TypeVar("T")
MAX_RERUNS = 3  # outages one rollout may live through; a server that keeps going down is the run's end
PROBE_SECONDS = 5.0
# How long one model call of a rollout may take. A server that answers its health check is working,
# only slowly: in a CI run at a third of its usual speed, one turn of a 32-episode batch took over
# 120 s, and so did each retry of it, and the run failed against a live server. A server that is
# down fails the call at once (a refused or reset connection) and is waited for by its health check.
MODEL_CALL_SECONDS = 600.0
GATEWAY_DOWN = frozenset({502, 503, 504})  # a proxy in front of a server that is down, or its engine down


def connection_failure(exc: BaseException) -> bool:
    """Whether `exc`, or what caused it, is a failure to reach a server (not a reply it gave)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (openai.APIConnectionError, httpx.TransportError, ConnectionError)):
            return True
        if getattr(e, "status_code", None) in GATEWAY_DOWN:
            return True
        e = e.__cause__ or e.__context__
    return False


class ServerWatch:
    """`run(make)`: `make()` awaited, and awaited again (a fresh rollout) after an outage of the
    server at `url` that it failed in."""

    def __init__(self, url: str | None, seconds: float | None, say: Callable[[str], None] | None = None):
        self.url, self.seconds = url, seconds
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._outage: asyncio.Future | None = None
        self._ended: float | None = None  # when the last outage ended (time.monotonic)
        self.gone: ServerUnreachable | None = None  # set when the server did not come back in time
        self.outages = 0

    async def run(self, make: Callable[[], Awaitable[T]]) -> T:
        for reruns in range(MAX_RERUNS + 1):
            started = time.monotonic()
            try:
                return await make()
            except Exception as exc:
                if self.gone is not None:
                    raise self.gone from exc
                if reruns == MAX_RERUNS or not connection_failure(exc) or not await self._outage_since(started):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _outage_since(self, started: float) -> bool:
        """True once an outage that began after `started` is over (waiting for it if it is not);
        False when the server answers and was never down since."""
        if self._outage is None or self._outage.done():
            if self._ended is not None and self._ended >= started:
                return True  # its calls were retrying through an outage that is over now
            if await self.answers():
                return False
        if self._outage is None or self._outage.done():  # another rollout may have begun the wait meanwhile
            self._outage = asyncio.ensure_future(self._wait())
        await asyncio.shield(self._outage)  # raises ServerUnreachable when it does not come back
        return True

    async def answers(self) -> bool:
        if not self.url:  # no server to ask (a stand-in model): every failure is the rollout's own
            return True
        try:
            async with httpx.AsyncClient(timeout=PROBE_SECONDS) as http:
                return (await http.get(self.url + "/health")).status_code < 500
        except httpx.HTTPError:
            return False

    async def _wait(self) -> None:
        self.outages += 1
        began = time.monotonic()
        bound = "without end" if self.seconds is None else f"up to {self.seconds:.0f} s"
        self.say(f"artisan: waiting for the server at {self.url} (retrying {bound}; ARTISAN_RETRY_SECONDS sets "
                 f"how long): rollouts that could not reach it will run again, not count as failed")

        async def check() -> None:
            async with httpx.AsyncClient(timeout=PROBE_SECONDS) as http:
                resp = await http.get(self.url + "/health")
            if resp.status_code >= 500:  # up, with its engine down (a replica restarting): not yet
                raise httpx.ConnectError(f"/health answered {resp.status_code}")

        policy = RetryPolicy(attempts=None, initial_wait=0.5, max_wait=4.0, seconds=self.seconds)
        try:
            await policy.call(check)
        except httpx.HTTPError as exc:
            self.gone = ServerUnreachable(self.url, exc)
            raise self.gone from None
        self._ended = time.monotonic()
        self.say(f"artisan: the server at {self.url} answers again after {self._ended - began:.0f} s; "
                 f"rerunning the rollouts it interrupted")


_watches: "weakref.WeakKeyDictionary[Any, ServerWatch]" = weakref.WeakKeyDictionary()


def watch_for(model: Any) -> ServerWatch:
    """The one watch of a TrainableModel (its server URL and retry window)."""
    url, seconds = getattr(model, "server_url", None), getattr(getattr(model, "retry", None), "seconds", None)
    watch = _watches.get(model)
    if watch is None or watch.url != url:
        watch = _watches[model] = ServerWatch(url, seconds)
    return watch
