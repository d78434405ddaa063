"""What every exporter shares: its outcome, its configuration error, how it fails fast."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol

import httpx

from exporters.flatten import Item


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


def send_each(items: list[Item], send: Callable[[Item], None]) -> Outcome:
    """Deliver trajectories one by one over HTTP. A refused one (4xx/5xx) fails alone; a
    transport failure means the endpoint is down or too slow, and the rest would wait the same
    timeout, so they are counted as failed, not tried."""
    out = Outcome()
    for n, item in enumerate(items):
        try:
            send(item)
            out.exported += 1
        except httpx.TransportError as exc:
            out.fail(len(items) - n, exc)
            break
        except Exception as exc:
            out.fail(1, exc)
    return out


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
    return ExportConfigError(f"the {exporter} exporter needs the `{package}` package: pip install -e '.[export]'")
