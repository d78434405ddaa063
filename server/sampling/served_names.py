"""The served names and what each one decodes with: the base model, `run` (its latest step) and
`run@N` (step N).

One table with one writer: runs publish their steps into it (server/runs/served_steps.py), requests
take names from it. A request holds its policy from the moment it finds it (`acquire`) until it is
answered, and a name is withdrawn for an unload only while no request holds its adapter, so the
adapter a request started on is never unloaded under it and it finishes on that step's weights.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from protocol.names import policy_name


@dataclass(frozen=True)
class Policy:
    """What a request's `model` resolved to."""

    name: str  # the name a client used (base name, run or run@step)
    adapter: str | None  # engine adapter name, None for the base model
    run: str | None
    step: int


class ServedModels:
    def __init__(self, base_name: str, aliases: set[str]):
        self.base = Policy(base_name, None, None, 0)
        self._aliases = set(aliases) | {base_name}
        self._policies: dict[str, Policy] = {}
        self._leases: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def base_aliases(self) -> set[str]:
        """Every name the base model answers to (its served name, the path or hub id it came from)."""
        return set(self._aliases)

    def resolve(self, name: str) -> Policy | None:
        if name in self._aliases:
            return self.base
        with self._lock:
            return self._policies.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return [self.base.name, *sorted(self._policies)]

    def publish(self, run: str, step: int, adapter: str, latest: bool) -> None:
        with self._lock:
            self._policies[policy_name(run, step)] = Policy(policy_name(run, step), adapter, run, step)
            if latest:
                self._policies[run] = Policy(run, adapter, run, step)

    def withdraw(self, name: str) -> None:
        with self._lock:
            self._policies.pop(name, None)

    # ---- leases ----------------------------------------------------------------------------------
    def acquire(self, name: str) -> Policy | None:
        """The policy `name` resolves to, held until `release`, in one step under the table's lock:
        `withdraw_idle` cannot come between finding an adapter and holding it."""
        if name in self._aliases:
            return self.base
        with self._lock:
            policy = self._policies.get(name)
            if policy is not None and policy.adapter is not None:
                self._leases[policy.adapter] += 1
            return policy

    def release(self, policy: Policy) -> None:
        if policy.adapter is not None:
            with self._lock:
                self._leases[policy.adapter] -= 1
                if self._leases[policy.adapter] <= 0:
                    del self._leases[policy.adapter]

    def in_use(self, adapter: str) -> bool:
        with self._lock:
            return self._leases[adapter] > 0

    def withdraw_idle(self, name: str, adapter: str) -> bool:
        """Withdraw `name` unless a request holds `adapter`; whether it was withdrawn (then no request
        can take the adapter by that name any more, and it may be unloaded)."""
        with self._lock:
            if self._leases[adapter] > 0:
                return False
            self._policies.pop(name, None)
            return True
