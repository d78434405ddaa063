"""On-policy distillation against RL from scratch, on the demo task (the embedded model).

The RL run is `make demo`'s (client.train, 16 groups x 8, its held-out evaluation every 4 steps)
and doubles as the teacher: its last step is what a student is distilled from. The student is a
fresh run of the same settings with `--teacher`, learning from the per-token reverse KL to the
teacher alone (its rewards are not read), so the two differ only in their learning signal. Both
curves are held-out reward against the client's wall-clock seconds; the figure is how long each
took to reach the teacher's final held-out reward (within one standard error), the RL run being
the baseline in the same run.

    python bench/distill.py                      # 16 steps each, about 10 minutes on 2 cores
    python bench/distill.py --steps 8

Prints one JSON line. Not run in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402
from examples.demo.run_demo import DEMO_ARGS  # noqa: E402


def train(url: str, run: str, out: Path, steps: int, *extra: str) -> dict:
    args = list(DEMO_ARGS)
    args[args.index("--steps") + 1] = str(steps)
    cmd = [sys.executable, "-m", "client.train", "--server", url, "--run", run, "--out", str(out), "--no-progress",
           "--seed", "0", *args, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def curve(summary: dict) -> list[tuple[int, float, float, float]]:
    """(step, wall seconds, held-out reward, its standard error) at each evaluation."""
    return [(e["step"], round(e["wall_seconds"], 1), round(e["reward"], 4), round(e["stderr"], 4))
            for e in summary["evals"]]


def seconds_to(points: list[tuple[int, float, float, float]], target: float) -> float | None:
    """The first evaluation's wall-clock seconds whose reward is within its standard error of `target`."""
    return next((s for _, s, r, se in points if r + se >= target), None)


def main(steps: int = typer.Option(16, help="Steps of each run."),
         coef: float = typer.Option(1.0, help="The student's --distill-coef."),
         with_reward: bool = typer.Option(False, help="The student also learns from the reward (--distill-with-reward).")
         ) -> None:
    with tempfile.TemporaryDirectory(prefix="distill-") as work:
        work = Path(work)
        with LocalServer(work / "data") as server:
            rl = curve(train(server.url, "rl", work / "rl", steps))
            student = curve(train(server.url, "student", work / "student", steps, "--teacher", "rl",
                                  "--distill-coef", str(coef), *(["--distill-with-reward"] if with_reward else [])))
    target = rl[-1][2]
    print(json.dumps({"task": "demo", "model": "artisan-tiny (embedded)", "steps": steps, "coef": coef,
                      "with_reward": with_reward,
                      "teacher_final_reward": target,
                      "rl_from_scratch_seconds_to_teacher_reward": seconds_to(rl, target),
                      "distilled_seconds_to_teacher_reward": seconds_to(student, target),
                      "rl_curve_step_seconds_reward_se": rl, "distilled_curve_step_seconds_reward_se": student}))


if __name__ == "__main__":
    typer.run(main)
