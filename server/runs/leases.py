"""Which client trains a run: one at a time.

`python -m client.train` holds its run's lease while it runs (client/model.py
`TrainableModel.lease`): it takes it when it starts, renews it in the background and releases it
when it ends. A second client asking for the lease is told who has had the run since when, at
once, instead of both training it and each finding the other's steps in its way. The lease id is
the client's own (a random one per client), so taking and renewing are one idempotent call, and
a server restart, which forgets every lease, costs nothing: the holder's next renewal takes it
again. A client killed without releasing frees the run when its lease expires.

Jobs: a submission that carries a lease id (the `X-Artisan-Lease` header) other than the
holder's, or none while a lease is held, is refused with the same line: while a client trains a
run, nobody else's step lands in it. With no lease held, anyone submits as before (ART's
client, sessions, scripts): the lease is only for clients that take it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

LEASE_SECONDS = 60.0  # a renewal-less lease lasts this long unless the client asks otherwise
HEADER = "X-Artisan-Lease"


@dataclass(frozen=True)
class Lease:
    id: str
    since: float  # wall clock, when the holder took it
    expires: float  # monotonic
    seconds: float


class LeaseHeld(Exception):
    """Another client holds the run's lease (a 409)."""

    def __init__(self, run: str, lease: Lease, left: float):
        self.run, self.lease = run, lease
        since = time.strftime("%H:%M", time.localtime(lease.since))
        super().__init__(f"run {run} is being trained by another client since {since}; stop it or use another "
                         f"--run (a client that stopped without releasing it frees the run within {left:.0f} s)")


class Leases:
    def __init__(self, clock=time.monotonic, wall=time.time):
        self._clock, self._wall = clock, wall
        self._held: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def _current(self, run: str) -> Lease | None:
        lease = self._held.get(run)
        if lease is not None and lease.expires <= self._clock():
            del self._held[run]
            return None
        return lease

    def hold(self, run: str, lease_id: str, seconds: float = LEASE_SECONDS) -> Lease:
        """Take the run's lease, or renew it when `lease_id` holds it; LeaseHeld when another does."""
        with self._lock:
            lease = self._current(run)
            if lease is not None and lease.id != lease_id:
                raise LeaseHeld(run, lease, lease.expires - self._clock())
            since = lease.since if lease is not None else self._wall()
            self._held[run] = Lease(lease_id, since, self._clock() + seconds, seconds)
            return self._held[run]

    def release(self, run: str, lease_id: str) -> bool:
        """Give the lease back; False when `lease_id` did not hold it (expired, or never taken)."""
        with self._lock:
            lease = self._current(run)
            if lease is None or lease.id != lease_id:
                return False
            del self._held[run]
            return True

    def check(self, run: str, lease_id: str | None) -> None:
        """May a job carrying `lease_id` (None: no lease) be queued on the run? LeaseHeld if not."""
        with self._lock:
            lease = self._current(run)
            if lease is not None and lease.id != lease_id:
                raise LeaseHeld(run, lease, lease.expires - self._clock())

    def drop(self, run: str) -> None:
        """The run is deleted: its lease goes with it."""
        with self._lock:
            self._held.pop(run, None)
