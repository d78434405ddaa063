"""Trajectory exporters: Langfuse (its SDK), Weave and OpenPipe (their HTTP APIs, with httpx).

art-server's `--export` queues each step's trajectories to them (server/export_queue.py); a laptop calls
them directly:

    from exporters import export_groups
    export_groups(groups, to="langfuse", run="my-run", step=3)   # reads LANGFUSE_* from the env

The Langfuse SDK is imported only when that exporter is made (`pip install -e '.[export]'`).
"""

from __future__ import annotations

from typing import Any, Iterable

from exporters.base import ExportConfigError, Exporter, Outcome
from protocol.trajectory import TrajectoryGroup
from exporters.flatten import items

EXPORTERS = ("langfuse", "weave", "openpipe")


def make_exporter(name: str, timeout: float = 10.0, **config: Any) -> Exporter:
    """An exporter by name; `config` overrides what it would read from the environment."""
    if name == "langfuse":
        from exporters.langfuse import LangfuseExporter

        return LangfuseExporter(timeout=timeout, **config)
    if name == "weave":
        from exporters.weave import WeaveExporter

        return WeaveExporter(timeout=timeout, **config)
    if name == "openpipe":
        from exporters.openpipe import OpenPipeExporter

        return OpenPipeExporter(timeout=timeout, **config)
    raise ExportConfigError(f"unknown exporter {name!r}; choose from {', '.join(EXPORTERS)}")


def export_groups(groups: Iterable[TrajectoryGroup], to: str | Exporter | list[str | Exporter], run: str,
                  step: int = 0, split: str = "train", timeout: float = 10.0) -> dict[str, Outcome]:
    """Send groups to one or more exporters now (blocking; wrap in `asyncio.to_thread` from async
    code). Returns each exporter's outcome; failures are counted there, not raised."""
    targets = to if isinstance(to, list) else [to]
    batch = items(list(groups), run, step, split)
    results: dict[str, Outcome] = {}
    for target in targets:
        exporter = make_exporter(target, timeout=timeout) if isinstance(target, str) else target
        try:
            results[exporter.name] = exporter.export(batch)
        finally:
            if isinstance(target, str):  # ours to close; a caller's exporter stays open for reuse
                exporter.close()
    return results


__all__ = ["EXPORTERS", "ExportConfigError", "Exporter", "Outcome", "export_groups", "make_exporter"]
