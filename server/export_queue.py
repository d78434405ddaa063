"""The server's queue to the trajectory exporters (Langfuse, Weave, OpenPipe; the `exporters`
package), off the training path: one thread and one bounded queue (a lane) per exporter.

`art-server --export langfuse --export openpipe` (or ARTISAN_EXPORT=langfuse,openpipe); each
exporter reads its own settings from the environment:

- langfuse: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST (or LANGFUSE_BASE_URL)
- weave: WANDB_API_KEY, WEAVE_PROJECT (entity/project), WF_TRACE_SERVER_URL (optional)
- openpipe: OPENPIPE_API_KEY, OPENPIPE_BASE_URL (optional)

A step hands its trajectories over with `submit`, which never blocks: when an exporter's queue is
full (its endpoint is down or slower than training), the batch is dropped and counted. Every
trajectory ends up counted once as exported, failed or dropped, so the operator sees what was lost.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from exporters import EXPORTERS, ExportConfigError, make_exporter
from exporters.base import Exporter, Outcome
from exporters.flatten import items

log = logging.getLogger("artisan.export")


def names(raw: list[str] | None) -> list[str]:
    out: list[str] = []
    for part in (p.strip().lower() for r in raw or [] for p in r.split(",")):
        if part and part not in out:
            out.append(part)
    unknown = [n for n in out if n not in EXPORTERS]
    if unknown:
        raise SystemExit(f"--export: unknown exporter {', '.join(unknown)}; choose from {', '.join(EXPORTERS)}")
    return out


def build(settings: Any) -> ExportQueue | None:
    """The queue to the exporters the settings ask for; None when none (the default).
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
    return ExportQueue(exporters, queue_size=settings.export_queue, timeout=settings.export_timeout)


class Lane:
    """One exporter's bounded queue and the thread that drains it."""

    def __init__(self, exporter: Exporter, queue_size: int):
        self.exporter = exporter
        self.queue: "queue.Queue[tuple[str, int, str, list[Any], int] | None]" = queue.Queue(maxsize=queue_size)
        self.counts = {"exported": 0, "failed": 0, "dropped": 0, "queued": 0, "in_flight": 0}
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_success_at: float | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self.thread = threading.Thread(target=self._work, name=f"artisan-export-{exporter.name}", daemon=True)
        self.thread.start()

    def offer(self, run: str, step: int, split: str, groups: list[Any], n: int) -> None:
        with self._lock:
            try:
                self.queue.put_nowait((run, step, split, groups, n))
                self.counts["queued"] += n
            except queue.Full:
                self.counts["dropped"] += n

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            run, step, split, groups, n = job
            if self._stopping:  # offered while closing: lost with the process, and counted so
                with self._lock:
                    self.counts["queued"] -= n
                    self.counts["dropped"] += n
                continue
            with self._lock:
                self.counts["queued"] -= n
                self.counts["in_flight"] = n
            try:
                outcome = self.exporter.export(items(groups, run, step, split))
            except Exception as exc:  # an exporter bug costs its batch, never the thread
                outcome = Outcome()
                outcome.fail(n, exc)
            self._record(outcome, run, step, split)

    def _record(self, outcome: Outcome, run: str, step: int, split: str) -> None:
        now = time.time()
        with self._lock:
            self.counts["exported"] += outcome.exported
            self.counts["failed"] += outcome.failed
            self.counts["in_flight"] = 0
            if outcome.exported:
                self.last_success_at = now
            if outcome.error:
                self.last_error, self.last_error_at = outcome.error, now
        if outcome.failed:
            log.warning("%s: %d trajectories of %s step %d (%s) not exported: %s", self.exporter.name,
                        outcome.failed, run, step, split, outcome.error)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"name": self.exporter.name, **self.counts, "last_error": self.last_error,
                    "last_error_at": self.last_error_at, "last_success_at": self.last_success_at}

    def close(self, timeout: float) -> None:
        with self._lock:
            self._stopping = True
            while True:  # what is still waiting is lost with the process: say so in the counts
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self.counts["queued"] -= job[4]
                    self.counts["dropped"] += job[4]
            self.queue.put_nowait(None)
        self.thread.join(timeout)
        if not self.thread.is_alive():  # closing under a running export would race it
            self.exporter.close()


class ExportQueue:
    """Every exporter's lane; what a step or a logged batch is handed to."""

    def __init__(self, exporters: list[Exporter], queue_size: int, timeout: float):
        self.timeout = timeout
        self.queue_size = queue_size
        self.lanes = [Lane(e, queue_size) for e in exporters]

    def submit(self, run: str, step: int, split: str, groups: list[Any]) -> None:
        """Queue a step's (or a logged batch's) groups for every exporter; returns at once."""
        n = sum(len(g.trajectories) for g in groups)
        if n:
            for lane in self.lanes:
                lane.offer(run, step, split, groups, n)

    def stats(self) -> dict[str, Any]:
        return {"queue_size": self.queue_size, "timeout_s": self.timeout, "data": [lane.stats() for lane in self.lanes]}

    def close(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for lane in self.lanes:
            lane.close(max(0.0, deadline - time.monotonic()))
