"""Who a request is (Caller), who created each run, and how many runs each key has: the record keys
per tenant are enforced against (`Owners.visible`, asked by every route and the sampling core).
Kept in memory, mirrored in the store's `runs` table, so a request's check never waits on a
database write.

A run's owner is a tenant's name, or None: the admin's (runs made with an admin key, runs from
before tenant keys, runs whose store row was lost). Only an admin key sees a run owned by None.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from server.store import Store


@dataclass(frozen=True)
class Caller:
    """Who a request is: an admin (every run), or a tenant (only its own runs)."""

    tenant: str | None  # the tenant's name; None for an admin key (or a server without keys)
    digest: str  # what a session or stored response is recorded under: a digest of the key

    @property
    def admin(self) -> bool:
        return self.tenant is None

    @property
    def owner(self) -> str | None:
        """What a run this caller creates is recorded as owned by."""
        return self.tenant


class NameTaken(Exception):
    """The name is another key's run."""


class RunLimit(Exception):
    """The key has as many runs as it may create."""


class Owners:
    def __init__(self, store: Store):
        self._store = store
        self._lock = threading.Lock()
        self._owners: dict[str, str | None] = {r["name"]: r["owner"] for r in store.runs.all()}

    def owner(self, name: str) -> str | None:
        return self._owners.get(name)

    def visible(self, who: Caller, name: str) -> bool:
        """Whether `who` may see run `name`: another tenant's run is, to it, a run that does not exist.
        A run with no recorded owner (the admin's, or one from before tenant keys) is the admin's."""
        return who.tenant is None or self._owners.get(name) == who.tenant

    def claim(self, name: str, owner: str | None, admin: bool, limit: int, project: str) -> bool:
        """Record `owner` as the creator of run `name` unless it is taken; True when this call
        recorded it (a run to make), False when the name was already the owner's."""
        with self._lock:
            if name in self._owners:
                if admin or self._owners[name] == owner:
                    return False
                raise NameTaken(name)
            have = sum(1 for o in self._owners.values() if o == owner)
            if have >= limit:
                raise RunLimit(f"this key has {have} runs, the most one key may create (art-server "
                               f"--max-runs-per-key {limit}); delete one, or use another name for an existing run")
            self._store.runs.add(name, project, owner)
            self._owners[name] = owner
            return True

    def release(self, name: str) -> None:
        """Forget a run's owner: its creation failed."""
        with self._lock:
            if name in self._owners:
                del self._owners[name]
                self._store.runs.forget(name)

    def erase(self, name: str) -> None:
        """A deleted run: everything the store holds of it (its row, steps, trajectories and jobs)
        and its owner, so its name and its place in its key's count of runs are free."""
        with self._lock:
            self._store.runs.delete(name)
            self._owners.pop(name, None)
