"""What the log and an error say, bounded: an error as one line, and a warning or error that repeats
(same logger, level and message format) logged a few times per window, then counted, and the count
told on the first one of the next window. A flood of bad connections or failing requests then costs
a few lines, not megabytes. Records below WARNING (access lines, progress) pass untouched."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

FIRST_PER_WINDOW = 5
WINDOW_S = 10.0
MAX_KINDS = 10_000  # messages remembered; more (formats built per call) start over


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An error as one bounded line (a state dict's size mismatch alone is 60 lines)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class _Seen:
    start: float
    logged: int = 0
    suppressed: int = 0


class CollapseRepeats(logging.Filter):
    def __init__(self, first: int = FIRST_PER_WINDOW, window: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.first, self.window, self.clock = first, window, clock
        self._seen: dict[tuple[str, int, str], _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or now - seen.start >= self.window:
            if len(self._seen) >= MAX_KINDS:
                self._seen.clear()
            self._seen[key] = _Seen(now, 1)
            if seen is not None and seen.suppressed:
                record.msg = f"{record.msg} [this message was repeated {seen.suppressed} more times in " \
                             f"{self.window:.0f} s and not logged]"
            return True
        if seen.logged < self.first:
            seen.logged += 1
            return True
        seen.suppressed += 1
        return False


def collapse_repeats_on(logger: logging.Logger) -> None:
    """Put a filter on each of the logger's handlers (a handler's filter sees records its loggers'
    children propagate to it; a logger's own filter would not)."""
    for handler in logger.handlers:
        if not any(isinstance(f, CollapseRepeats) for f in handler.filters):
            handler.addFilter(CollapseRepeats())


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration, with repeats collapsed on its handlers."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["collapse_repeats"] = {"()": CollapseRepeats}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("collapse_repeats")
    return config
