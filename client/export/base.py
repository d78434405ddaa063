"""What every exporter shares: its outcome, its configuration error, how it fails fast."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from client.export.turns import Item


class ExportConfigError(ValueError):
    """An exporter asked for but not usable (a missing key or SDK): said once, at start-up."""


@dataclass
class Outcome:
    exported: int = 0  # trajectories delivered
    failed: int = 0  # trajectories that did not get there
    error: str | None = None  # the last failure, for the operator

    def fail(self, n: int, exc: BaseException) -> None:
        self.failed += n
        self.error = f"{type(exc).__name__}: {exc}"[:500]


class Exporter(Protocol):
    name: str

    def export(self, items: list[Item]) -> Outcome: ...

    def close(self) -> None: ...


def env(*names: str, default: str | None = None) -> str | None:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return default


def require(value: str | None, what: str, exporter: str) -> str:
    if not value:
        raise ExportConfigError(f"the {exporter} exporter needs {what}")
    return value


def missing_sdk(package: str, exporter: str) -> ExportConfigError:
    return ExportConfigError(f"the {exporter} exporter needs the `{package}` package: pip install 'artisan[export]'")
