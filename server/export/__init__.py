"""Optional exporters of trajectories (Langfuse, Weave, OpenPipe), off by default.

`art-server --export langfuse --export openpipe` (or ARTISAN_EXPORT=langfuse,openpipe); each
exporter reads its own settings from the environment:

- langfuse: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST (or LANGFUSE_BASE_URL)
- weave: WANDB_API_KEY, WEAVE_PROJECT (entity/project), WF_TRACE_SERVER_URL (optional)
- openpipe: OPENPIPE_API_KEY, OPENPIPE_BASE_URL (optional)

The exporters themselves live in the top-level `exporters` package, so a laptop can export the
same way without a server; here they only get a queue and a thread each (dispatcher.py).
"""

from __future__ import annotations

from typing import Any

from exporters import EXPORTERS, ExportConfigError, make_exporter
from server.export.dispatcher import Dispatcher


def names(raw: list[str] | None) -> list[str]:
    out: list[str] = []
    for part in (p.strip().lower() for r in raw or [] for p in r.split(",")):
        if part and part not in out:
            out.append(part)
    unknown = [n for n in out if n not in EXPORTERS]
    if unknown:
        raise SystemExit(f"--export: unknown exporter {', '.join(unknown)}; choose from {', '.join(EXPORTERS)}")
    return out


def build(settings: Any) -> Dispatcher | None:
    """The dispatcher for the exporters the settings ask for; None when none (the default).
    A misconfigured exporter stops the server at start rather than losing every step quietly."""
    wanted = names(settings.export)
    if not wanted:
        return None
    exporters = []
    for name in wanted:
        try:
            exporters.append(make_exporter(name, timeout=settings.export_timeout))
        except ExportConfigError as e:
            raise SystemExit(f"--export {name}: {e}") from None
    return Dispatcher(exporters, queue_size=settings.export_queue, timeout=settings.export_timeout)
