"""A batch's figures per domain, for runs that train on several task families at once (tau2-bench's
retail, airline and telecom): a mean over the whole batch hides the domain that does not learn.

A group's domain is its `metadata["domain"]` (client.train sets it from the task), else the one
domain its trajectories' metadata name. Per domain, over the rollouts submitted (before groups
without signal or too stale are dropped, so a domain whose groups all dropped still shows): how
many there were and how many failed (excluded, by the exception's type, so a flaky user simulator shows as itself), their mean
reward, and the mean of every trajectory metric that all of the domain's trajectories report (a
metric some trajectories lack, such as a stop-reason flag, has no mean that means anything).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Iterable

from protocol.trajectory import TrajectoryGroup

DOMAIN_KEY = "domain"
Figure = float | int | None
# Exceptions travel as "TypeName: message" (client.gather, TrajectoryGroup._stringify).
_KIND = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*):")


def group_domain(group: TrajectoryGroup) -> str | None:
    named = group.metadata.get(DOMAIN_KEY)
    if named is not None:
        return str(named)
    found = {None if (d := t.metadata.get(DOMAIN_KEY)) is None else str(d) for t in group.trajectories}
    return found.pop() if len(found) == 1 and None not in found else None


def exception_kind(exception: str) -> str:
    match = _KIND.match(exception)
    return match.group(1).rsplit(".", 1)[-1] if match else "Exception"


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def domain_figures(groups: Iterable[TrajectoryGroup]) -> dict[str, dict[str, Figure]]:
    """{domain: figures}; empty when no group names a domain."""
    by_domain: dict[str, list[TrajectoryGroup]] = defaultdict(list)
    for g in groups:
        domain = group_domain(g)
        if domain is not None:
            by_domain[domain].append(g)
    out: dict[str, dict[str, Figure]] = {}
    for domain, members in sorted(by_domain.items()):
        trajs = [t for g in members for t in g.trajectories]
        exceptions = [e for g in members for e in g.exceptions]
        figures: dict[str, Figure] = {}
        shared = set.intersection(*(set(t.metrics) for t in trajs)) if trajs else set()
        for key in sorted(shared):
            values = [_number(t.metrics[key]) for t in trajs]
            if all(v is not None for v in values):
                figures[key] = sum(values) / len(values)  # type: ignore[arg-type]
        figures["trajectories"] = len(trajs)
        figures["excluded"] = len(exceptions)
        figures["reward_mean"] = sum(t.reward for t in trajs) / len(trajs) if trajs else None
        for e in exceptions:
            key = f"excluded_{exception_kind(e)}"
            figures[key] = int(figures.get(key) or 0) + 1
        out[domain] = figures
    return out
