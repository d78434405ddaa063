"""The step a run's bare name serves when it is not the latest: a pin (`PUT /v1/runs/{name}/serving`,
`client.train --keep-best`), to serve the best held-out step of a run that got worse.

`run@N` serves every step as before, and training goes on from the latest weights: the run's next
published step is served under its name again (ServedSteps.publish drops the pin). The pin is a
file in the run's folder, written before it is served, so that a restart serves what was answered;
it records the latest step it was made at, so that a pin the run trained past (a crash between the
step's checkpoint and the pin's removal) is dropped at start rather than served.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from protocol.names import policy_name
from server.log_limits import one_line
from server.runs import checkpoints

if TYPE_CHECKING:
    from server.runs.run import Run
    from server.runs.served_steps import ServedSteps

log = logging.getLogger("artisan.runs")
PIN_FILE = "serving.json"


def pin(serving: ServedSteps, run: Run, step: int | None) -> None:
    """Serve step `step` under the run's bare name (None, or the latest itself: the latest again).
    KeyError: the run has no checkpoint of that step; CheckpointDamaged: it cannot be read."""
    with serving.lock:  # the runs' one lock: a step being published or unloaded meanwhile waits
        if step is None or step == run.step:
            drop(run)
            adapter = run.snapshots.get(run.step)
            if adapter is not None:  # else its step is being published, which serves it under the name
                serving.served.publish(run.name, run.step, adapter, latest=True)
            return
        if step not in checkpoints.steps(run.checkpoint_dir):
            raise KeyError(step)
        policy = serving.resolve(policy_name(run.name, step))  # loaded from its checkpoint when it is not
        if policy is None:
            raise KeyError(step)
        tmp = run.dir / f"{PIN_FILE}.tmp"
        tmp.write_text(json.dumps({"step": step, "latest": run.step}))
        os.replace(tmp, run.dir / PIN_FILE)
        run.serving_step = step  # ServedSteps.unload keeps its adapter loaded from here on
        serving.served.publish(run.name, step, policy.adapter, latest=True)


def drop(run: Run) -> None:
    """No pin: the name serves what the next publish (or the caller) makes it serve."""
    run.serving_step = None
    (run.dir / PIN_FILE).unlink(missing_ok=True)


def restore(serving: ServedSteps, run: Run) -> None:
    """A resumed run's pin, served again; one it trained past, or that cannot be served, is dropped
    (the run is served either way: at its latest step)."""
    path = run.dir / PIN_FILE
    if not path.exists():
        return
    try:
        found = json.loads(path.read_text())
        step, latest = int(found["step"]), int(found["latest"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("run %s: %s cannot be read (%s); its name serves its latest step", run.name, path, exc)
        drop(run)
        return
    if latest != run.step:
        drop(run)
        return
    try:
        pin(serving, run, step)
    except Exception as exc:
        why = "no checkpoint" if isinstance(exc, KeyError) else one_line(exc)
        log.warning("run %s: its pinned step %d cannot be served (%s); its name serves step %d", run.name, step, why,
                    run.step)
        drop(run)
