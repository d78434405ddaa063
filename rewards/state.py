"""Compare an episode's final database state with the expected one (tau-bench's main reward).

A database is a JSON-like dict of tables; a table is either a dict of id -> record or a list of
records. Lists anywhere are compared as multisets: the order rows were appended in, or items were
listed in, is not something an agent should be graded on.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any, Mapping

from pydantic import BaseModel

from rewards.canonical import canonical_json

_ABSENT = object()


class StateComparison(BaseModel):
    match: bool
    # Readable lines, e.g. "orders/O123.status: expected 'cancelled', got 'pending'".
    diff: list[str]
    records_matched: int
    records_total: int
    # Partial credit: matching records over records counted (1.0 when none are counted).
    records_match_fraction: float


def state_hash(state: Any) -> str:
    """A stable sha256 of a state; equal for any two states that `compare_states` calls a match."""
    return hashlib.sha256(_key(state).encode()).hexdigest()


def compare_states(
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    baseline: Mapping[str, Any] | None = None,
    max_diff_lines: int = 50,
) -> StateComparison:
    """Compare two states record by record.

    `baseline` is the state before the episode. When given, records equal in all three states are
    left out of the partial-credit counts: in a database of hundreds of records a task touches one,
    and "99% of records match" for doing nothing would be a reward for doing nothing.
    """
    diff: list[str] = []
    matched = total = 0
    for table in sorted(set(actual) | set(expected), key=str):
        got, want = actual.get(table, _ABSENT), expected.get(table, _ABSENT)
        if got is _ABSENT:
            diff.append(f"{table}: table missing")
            got = _empty_like(want)
        elif want is _ABSENT:
            diff.append(f"{table}: unexpected table")
            want = _empty_like(got)
        base = baseline.get(table, _ABSENT) if baseline is not None else _ABSENT
        m, t = _compare_table(str(table), got, want, base, diff)
        matched, total = matched + m, total + t
    # Every inequality writes at least one diff line, so no lines means equal states.
    match = not diff
    if len(diff) > max_diff_lines:
        diff = diff[:max_diff_lines] + [f"... and {len(diff) - max_diff_lines} more differences"]
    return StateComparison(
        match=match,
        diff=diff,
        records_matched=matched,
        records_total=total,
        records_match_fraction=matched / total if total else 1.0,
    )


def _compare_table(name: str, got: Any, want: Any, base: Any, diff: list[str]) -> tuple[int, int]:
    """Append the table's differences to `diff`; return (records matched, records counted)."""
    if isinstance(got, dict) and isinstance(want, dict):
        matched = counted = 0
        for rid in sorted(set(got) | set(want), key=str):
            path = f"{name}/{rid}"
            if rid not in got:
                diff.append(f"{path}: missing (expected {_short(want[rid])})")
            elif rid not in want:
                diff.append(f"{path}: unexpected record {_short(got[rid])}")
            elif _key(got[rid]) == _key(want[rid]):
                if isinstance(base, dict) and rid in base and _key(base[rid]) == _key(got[rid]):
                    continue  # untouched by the task and by the agent
                matched += 1
            else:
                _diff_values(path, got[rid], want[rid], diff)
            counted += 1
        return matched, counted
    if isinstance(got, list) and isinstance(want, list):
        got_rows, want_rows = Counter(map(_key, got)), Counter(map(_key, want))
        for row in sorted((want_rows - got_rows).elements()):
            diff.append(f"{name}[]: missing record {_truncate(row)}")
        for row in sorted((got_rows - want_rows).elements()):
            diff.append(f"{name}[]: unexpected record {_truncate(row)}")
        untouched = got_rows & want_rows & Counter(map(_key, base)) if isinstance(base, list) else Counter()
        both, either = got_rows & want_rows, got_rows | want_rows
        return sum(both.values()) - sum(untouched.values()), sum(either.values()) - sum(untouched.values())
    # A scalar "table", or a table whose shape changed: one record, equal or not.
    if _key(got) == _key(want):
        return (0, 0) if base is not _ABSENT and _key(base) == _key(got) else (1, 1)
    diff.append(f"{name}: expected {_short(want)}, got {_short(got)}")
    return 0, 1


def _diff_values(path: str, got: Any, want: Any, diff: list[str]) -> None:
    if isinstance(got, dict) and isinstance(want, dict):
        for field in sorted(set(got) | set(want), key=str):
            sub = f"{path}.{field}"
            if field not in got:
                diff.append(f"{sub}: missing (expected {_short(want[field])})")
            elif field not in want:
                diff.append(f"{sub}: unexpected {_short(got[field])}")
            else:
                _diff_values(sub, got[field], want[field], diff)
    elif _key(got) != _key(want):
        diff.append(f"{path}: expected {_short(want)}, got {_short(got)}")


def _empty_like(value: Any) -> Any:
    return type(value)() if isinstance(value, (dict, list)) else None


def _key(value: Any) -> str:
    return canonical_json(value, sort_lists=True)


def _short(value: Any) -> str:
    return _truncate(repr(value))


def _truncate(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
