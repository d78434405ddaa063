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
from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, stop_after_delay,
                      stop_never, wait_exponential_jitter)

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
    attempts: int | None = 5  # None: as many as `seconds` allows
    initial_wait: float = 0.5
    max_wait: float = 8.0
    transient: Transient = field(default=is_transient)
    seconds: float | None = None  # give up once this long has passed since the first try
    # Called before each wait with (the failure, the seconds left or None): how a caller says it is waiting.
    on_retry: Callable[[BaseException, float | None], None] | None = None

    def retrying(self) -> AsyncRetrying:
        stop = stop_after_attempt(self.attempts) if self.attempts is not None else stop_never
        if self.seconds is not None:
            stop = stop | stop_after_delay(self.seconds)
        return AsyncRetrying(
            retry=retry_if_exception(self.transient),
            stop=stop,
            wait=wait_exponential_jitter(initial=self.initial_wait, max=self.max_wait, jitter=self.initial_wait),
            before_sleep=self._before_sleep if self.on_retry is not None else None,
            reraise=True,
        )

    def _before_sleep(self, state: RetryCallState) -> None:
        left = None if self.seconds is None else max(0.0, self.seconds - state.seconds_since_start)
        self.on_retry(state.outcome.exception(), left)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        async for attempt in self.retrying():
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover
