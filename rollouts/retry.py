"""Retries for transient failures only.

A connection error, a timeout, a 429 or a 5xx says nothing about the agent, so the call is
retried with exponential backoff and jitter. Anything else (a 400, a bug) fails at once. A call
that still fails after the retries raises, and the rollout becomes an exception of its group,
never a zero reward (invariant 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import httpx
import openai
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                        openai.InternalServerError, httpx.TransportError, httpx.TimeoutException,
                        ConnectionError, TimeoutError)):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


@dataclass
class RetryPolicy:
    attempts: int = 5
    initial_wait: float = 0.5
    max_wait: float = 8.0

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        retrying = AsyncRetrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential_jitter(initial=self.initial_wait, max=self.max_wait),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

