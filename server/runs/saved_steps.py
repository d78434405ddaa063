"""A run's checkpoints as the run sees them: saved, loaded, rolled back to, listed, deleted, pruned."""

from __future__ import annotations

import math
from typing import Any

from server.model.host import ModelHost
from server.runs import checkpoints
from server.runs.run import Run
from server.runs.served_steps import ServedSteps


class SavedSteps:
    def __init__(self, host: ModelHost, serving: ServedSteps):
        self.host = host
        self.serving = serving  # a deleted checkpoint's step is unloaded too

    def save(self, run: Run, step: int, meta: dict[str, Any]) -> None:
        """The trained adapter and its optimizer state, atomically, as checkpoint `step`."""
        with self.host.lock:
            state = self.host.adapter_state(run.adapter)
        checkpoints.write(run.checkpoint_dir, step, state, run.optimizer.state_dict(), meta)

    def load(self, run: Run, step: int, check: bool = True) -> None:
        """The run's adapter and optimizer state from checkpoint `step` (`check`: damage is told first,
        unless the caller has just checked it)."""
        if check:
            checkpoints.check(run.checkpoint_dir, step)
        state = checkpoints.read_adapter(run.checkpoint_dir, step)
        with self.host.lock:
            self.host.load_adapter_state(run.adapter, state)
        run.optimizer.load_state_dict(checkpoints.read_optimizer(run.checkpoint_dir, step))

    def restore(self, run: Run) -> None:
        """Back to the latest checkpoint's weights and optimizer state (a step that failed midway)."""
        self.load(run, run.step)

    def entries(self, run: Run) -> list[dict[str, Any]]:
        """Each checkpoint's step, figures and time of writing; a damaged one says what is wrong."""
        out = []
        for step in checkpoints.steps(run.checkpoint_dir):
            try:
                meta = checkpoints.read_meta(run.checkpoint_dir, step)
            except checkpoints.CheckpointDamaged as exc:
                out.append({"step": step, "metrics": {}, "created": None, "damaged": str(exc)})
                continue
            out.append({"step": step, "metrics": meta.get("metrics", {}), "created": meta.get("created")})
        return out

    def delete(self, run: Run, step: int) -> None:
        """ValueError: the step is the run's state or what its name serves; KeyError: no such checkpoint."""
        if step == run.step:
            raise ValueError("the latest checkpoint is the run's state and cannot be deleted")
        if step == run.serving_step:
            raise ValueError(f"step {step} is what run {run.name} serves (pinned: PUT /v1/runs/{run.name}/serving "
                             f"{{\"step\": null}} serves the latest again); it cannot be deleted while it is")
        if step not in checkpoints.steps(run.checkpoint_dir):
            raise KeyError(step)
        self.serving.unload(run, step)
        checkpoints.delete(run.checkpoint_dir, step)

    def prune(self, run: Run, best_metric: str | None = None, mode: str = "max", keep_last: int = 1) -> list[int]:
        """Delete old checkpoints, keeping the latest `keep_last` and the best by `best_metric`."""
        infos = self.entries(run)
        keep = {i["step"] for i in infos[-keep_last:]} | {run.step} | \
            ({run.serving_step} if run.serving_step is not None else set())
        scored = [i for i in infos if isinstance(v := i["metrics"].get(best_metric or ""), (int, float))
                  and math.isfinite(v)]
        if best_metric and scored:
            pick = max if mode == "max" else min
            keep.add(pick(scored, key=lambda i: i["metrics"][best_metric])["step"])
        deleted = []
        for i in infos:
            if i["step"] not in keep:
                self.delete(run, i["step"])
                deleted.append(i["step"])
        return deleted
