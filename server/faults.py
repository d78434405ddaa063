"""Crash points for the crash tests: `ARTISAN_CRASH_AT=<point>` makes the server SIGKILL itself
there, the way a power cut or the OOM killer would, at an exact moment instead of a lucky one.
Unset (always, outside the tests), each point is one dictionary lookup."""

from __future__ import annotations

import os
import signal

POINTS = ("step_start", "pending_stored", "checkpoint_written", "checkpoint_renamed", "step_confirmed")


def crash_point(name: str) -> None:
    if os.environ.get("ARTISAN_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
