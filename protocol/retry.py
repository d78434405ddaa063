"""The one retry policy: transient failures are retried with exponential backoff and jitter,
anything else fails at once.

What counts as transient is a parameter, because it depends on who is calling: a rollout treats
a connection error, a timeout, a 429 or a 5xx as transient (they say nothing about the agent); a
judge adds its own invalid replies. A call that still fails after the retries raises, and a
rollout then becomes an exception of its group, never a zero reward (invariant 4).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import httpx
import openai
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

T = TypeVar("T")
Transient = Callable[[BaseException], bool]

TRANSIENT_STATUS = frozenset({408, 425, 429})


def transient_status(status: int | None, extra: frozenset[int] = frozenset()) -> bool:
    return isinstance(status, int) and (status >= 500 or status in TRANSIENT_STATUS or status in extra)


def is_transient(exc: BaseException) -> bool:
    """Network trouble, a timeout, an overloaded or failing server: worth another try."""
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, httpx.TransportError,
                        httpx.TimeoutException, ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    return transient_status(getattr(exc, "status_code", None) or getattr(exc, "status", None))


@dataclass
class RetryPolicy:
    attempts: int = 5
    initial_wait: float = 0.5
    max_wait: float = 8.0
    transient: Transient = field(default=is_transient)

    def retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(self.transient),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(initial=self.initial_wait, max=self.max_wait, jitter=self.initial_wait),
            reraise=True,
        )

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        async for attempt in self.retrying():
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover
