"""Exporting trajectories from a laptop, the same way art-server's `--export` does.

    from client.export import export_groups
    export_groups(groups, to="langfuse", run="my-run", step=3)   # reads LANGFUSE_* from the env

Exporters: langfuse (its SDK), weave and openpipe (their HTTP APIs, with httpx). The
Langfuse SDK is imported only when that exporter is made (`pip install 'artisan[export]'`). JSONL export
and import of a run's trajectories, with token ids and logprobs, are in `client.export.jsonl`.
"""

from __future__ import annotations

from typing import Any, Iterable

from client.export.base import ExportConfigError, Exporter, Outcome
from client.export.jsonl import download_jsonl, groups_from_jsonl, import_jsonl, read_jsonl
from client.export.turns import Item, Turn, items, turns
from client.types import TrajectoryGroup

EXPORTERS = ("langfuse", "weave", "openpipe")


def make_exporter(name: str, timeout: float = 10.0, **config: Any) -> Exporter:
    """An exporter by name; `config` overrides what it would read from the environment."""
    if name == "langfuse":
        from client.export.langfuse import LangfuseExporter

        return LangfuseExporter(timeout=timeout, **config)
    if name == "weave":
        from client.export.weave import WeaveExporter

        return WeaveExporter(timeout=timeout, **config)
    if name == "openpipe":
        from client.export.openpipe import OpenPipeExporter

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


__all__ = ["EXPORTERS", "ExportConfigError", "Exporter", "Item", "Outcome", "Turn", "download_jsonl",
           "export_groups", "groups_from_jsonl", "import_jsonl", "items", "make_exporter", "read_jsonl", "turns"]
