"""The loop's record of a run: summary.json, reward.png, and the judge's figures per step."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from client.loop.decline import best_eval
from client.loop.task_draws import TaskDraws
from protocol.trajectory import TrajectoryGroup


def plot(history: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(h["step"], h["reward_mean"]) for h in history if h.get("reward_mean") is not None]
    if train:
        ax.plot(*zip(*train), marker=".", label="train reward (rollouts of the step)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["reward"] for e in evals], marker="o", label="held-out eval reward")
    ax.set_xlabel("policy step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    levels = [(h["step"], h["curriculum_level"]) for h in history if h.get("curriculum_level") is not None]
    if levels:  # a curriculum's level, on its own axis
        lx = ax.twinx()
        lx.step(*zip(*levels), where="post", color="gray", alpha=0.6, label="curriculum level")
        lx.set_ylabel("curriculum level")
        lx.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        lx.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def judge_figures(groups: list[TrajectoryGroup]) -> dict[str, int] | None:
    """A step's judge calls, summed over its groups (rewards.ruler puts them in each group's
    metadata, judged, failed or skipped): judgments made, failed, skipped (nothing to compare),
    attempts, malformed replies."""
    found = [g.metadata["ruler"] for g in groups if isinstance(g.metadata.get("ruler"), dict)]
    if not found:
        return None
    from rewards.ruler import JUDGMENT_FIGURES  # already imported by whatever judged them

    return {name: sum(int(f.get(name, 0)) for f in found) for name in JUDGMENT_FIGURES}


def judge_line(figures: dict[str, int]) -> str:
    return (f"  judge: {figures['judged']} groups judged, {figures['failed']} failed, {figures['skipped']} with nothing "
            f"to compare; {figures['malformed']} malformed replies in {figures['attempts']} calls")


class Summary:
    """The loop's record in `out/summary.json`: evals, per-step figures, time spent. A restart that
    resumes the run at step `resumed_at` keeps the record up to that step; a run that starts over
    (step 0: a new server, or its data wiped) starts a new record, so that its "before" is its own."""

    def __init__(self, path: Path, run: str, resumed_at: int):
        self.path, self.run, self.started = path, run, time.time()
        previous = json.loads(path.read_text()) if path.exists() else {}
        same = previous.get("run") == run and resumed_at > 0
        self.history: list[dict[str, Any]] = [h for h in previous.get("history", []) if h["step"] <= resumed_at] \
            if same else []
        self.evals: list[dict[str, Any]] = [e for e in previous.get("evals", []) if e["step"] <= resumed_at] \
            if same else []
        self.seconds_before = previous.get("seconds", 0.0) if same else 0.0
        self.rollout_workers: dict[str, Any] | None = None  # the Ray workers' figures, when rollouts ran there
        self.keep_best: dict[str, Any] | None = None  # what --keep-best made the run's name serve
        # --warm-start's SFT step (its step, demonstrations, loss): the start GRPO's gain counts from
        self.warm_start: dict[str, Any] | None = previous.get("warm_start") if same else None
        # Training tasks the record's run drew at its level: a resumed run goes on with the draws after them.
        self.resumed_draws: int = previous.get("tasks_drawn", 0) if same else 0
        self.draws: TaskDraws | None = None  # the loop's task draws, whose count write() keeps

    @property
    def tasks_drawn(self) -> int:
        return self.draws.drawn if self.draws is not None else self.resumed_draws

    def judge_totals(self) -> dict[str, int] | None:
        """The judge's figures over every training attempt (see judge_figures)."""
        steps = [h["judge"] for h in self.history if h.get("judge")]
        return {k: sum(j.get(k, 0) for j in steps) for k in steps[0]} if steps else None

    def write(self, stopped: dict[str, Any] | None = None) -> dict[str, Any]:
        """`stopped`: why the loop gave up before its last step (cause and message), if it did."""
        summary = {"run": self.run, "eval_reward_before": self.evals[0]["reward"],
                   "eval_reward_after": self.evals[-1]["reward"],
                   "steps": self.history[-1]["step"] if self.history else self.evals[-1]["step"],
                   "seconds": self.seconds_before + time.time() - self.started,
                   **({"judge": judge} if (judge := self.judge_totals()) else {}),
                   **({"stopped": stopped} if stopped else {}),
                   **({"rollout_workers": self.rollout_workers} if self.rollout_workers else {}),
                   "best_step": best_eval(self.evals),
                   **({"keep_best": self.keep_best} if self.keep_best else {}),
                   **({"warm_start": self.warm_start} if self.warm_start else {}),
                   "tasks_drawn": self.tasks_drawn,
                   "evals": self.evals, "history": self.history}
        self.path.write_text(json.dumps(summary, indent=2))
        return summary
