"""Reproducible sampling: a seed for every model call of a rollout, derived from the run's seed.

art-server samples a request that names a `seed` from a generator of its own, whatever else shares
its batch, so a run is reproducible when every request names one. The seeds must differ between
the members of a group (one seed for all would make every member the same answer, a group with no
signal) and between the turns of one rollout. A rollout runs under `seeded(...)` with its own seed;
each call in it takes the next seed of that stream (`next_request_seed`). The stream lives in a
context variable so that an example's own rollout code (`Example.rollout`) needs no new argument.
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Awaitable, TypeVar

T = TypeVar("T")


def derive_seed(*parts: object) -> int:
    """A seed in [0, 2**63) from any parts: the same parts give the same seed on every machine."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class SeedStream:
    """The seeds of one rollout's calls, in the order it makes them."""

    def __init__(self, seed: int):
        self.seed, self.calls = seed, 0

    def next(self) -> int:
        self.calls += 1
        return derive_seed(self.seed, self.calls)


_STREAM: contextvars.ContextVar[SeedStream | None] = contextvars.ContextVar("artisan_rollout_seed", default=None)


def next_request_seed() -> int | None:
    """The seed the current rollout's next model call names; None outside a seeded rollout."""
    stream = _STREAM.get()
    return None if stream is None else stream.next()


async def seeded(rollout: Awaitable[T], seed: int | None) -> T:
    """Await `rollout` with its calls seeded from `seed` (None: unseeded, as it was)."""
    token = _STREAM.set(None if seed is None else SeedStream(seed))
    try:
        return await rollout
    finally:
        _STREAM.reset(token)
