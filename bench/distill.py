"""On-policy distillation against RL from scratch and against TRL, on the demo task (the embedded model).

The RL run is `make demo`'s (client.train, 16 groups x 8, its held-out evaluation every 4 steps)
and doubles as the teacher: its last step is what the students are distilled from.

- artisan's student is a fresh run with `--teacher`, learning from the per-token reverse KL to the
  teacher alone (its rewards are not read). It samples one episode per task, 32 tasks a step: the
  teacher's KL needs no group of siblings to compare with, which is what makes RL sample 8 per task.
- TRL's student is DistillationTrainer (bench/distill_trl.py) from a fresh LoRA, taught by the same
  teacher with the same episodes per step, learning rate, temperature and turn limits.

Two measures, each the same for everyone it compares:
1. client.train's own held-out evaluation (64 tasks sampled at the demo's temperature) against its
   wall-clock seconds: RL against artisan's student, the figure the README quotes.
2. greedy episodes on the same 64 tasks, in process, read by art-server's chat format
   (bench/trl_agents.greedy_reward), against training seconds (sampling and training, evaluation
   left out): RL, artisan's student and TRL's student, every 2 steps, from saved adapters.
A run reaches the teacher's reward at the first point within one standard error of the difference.

    python bench/distill.py                      # 16 steps each, about 8 minutes on 2 cores
    python bench/distill.py --steps 8 --no-trl

Prints one JSON line. Not run in CI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402
from examples.demo import task as demo  # noqa: E402
from examples.demo.run_demo import DEMO_ARGS  # noqa: E402
from server.settings import DEFAULT_MODEL_DIR  # noqa: E402
from trl_agents import export_peft, greedy_reward  # noqa: E402

SETTINGS = demo.ShopExample().settings  # the demo's turn limit, tokens a turn and temperature


def train(url: str, run: str, out: Path, steps: int, *extra: str) -> dict:
    args = list(DEMO_ARGS)
    args[args.index("--steps") + 1] = str(steps)
    cmd = [sys.executable, "-m", "client.train", "--server", url, "--run", run, "--out", str(out), "--no-progress",
           "--seed", "0", *args, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def binomial_se(reward: float, n: int) -> float:
    return math.sqrt(max(reward * (1 - reward), 0.0) / n)


def seconds_to(points: list[list[float]], target: float, target_se: float) -> float | None:
    """The first point's seconds whose reward is within one standard error of the difference from
    `target`. A point is [step, seconds, reward, its standard error]."""
    return next((s for _, s, r, se in points if target - r <= math.hypot(se, target_se)), None)


def client_curve(summary: dict) -> list[list[float]]:
    """[step, wall seconds, held-out reward, its standard error] at each of client.train's evaluations."""
    return [[e["step"], round(e["wall_seconds"], 1), round(e["reward"], 4), round(e["stderr"], 4)]
            for e in summary["evals"]]


def training_seconds(summary: dict) -> dict[int, float]:
    """Each trained step's seconds of sampling and training since the run began (evaluations left out)."""
    seconds, elapsed = {0: 0.0}, 0.0
    for h in summary["history"]:
        elapsed += h.get("timing", {}).get("wall_seconds") or 0.0
        if h["trained"]:
            seconds[h["step"]] = elapsed
    return seconds


def greedy_point(step: int, seconds: float, adapter: Path | None, eval_tasks: list) -> list[float]:
    reward = greedy_reward(DEFAULT_MODEL_DIR, adapter, [demo.ShopEnv(t) for t in eval_tasks], None,
                           SETTINGS.max_turns, SETTINGS.max_tokens)
    return [step, round(seconds, 1), round(reward, 4), round(binomial_se(reward, len(eval_tasks)), 4)]


def artisan_greedy(data: Path, run: str, summary: dict, adapters: Path, eval_tasks: list, every: int) -> list[list[float]]:
    """Measure 2 of an art-server run, from its adapters saved every `every` steps and at its last."""
    seconds, root = training_seconds(summary), data / "runs" / run
    return [greedy_point(s, seconds[s], export_peft(root / "checkpoints", s, root / "run.json", adapters / f"{run}-{s}"),
                         eval_tasks) for s in sorted(seconds) if s and (s % every == 0 or s == max(seconds))]


def main(steps: int = typer.Option(16, help="Steps of each run."),
         coef: float = typer.Option(1.0, help="artisan's student's --distill-coef."),
         with_reward: bool = typer.Option(False, help="artisan's student also learns from the reward "
                                                      "(--distill-with-reward; then it samples groups of 8)."),
         tasks_per_step: int = typer.Option(32, help="The students' tasks a step, one episode each."),
         greedy_every: int = typer.Option(2, help="Steps between the points of measure 2."),
         trl: bool = typer.Option(True, help="Also run TRL's DistillationTrainer.")) -> None:
    eval_tasks = demo.ShopExample().eval_tasks()
    student_args = ["--teacher", "rl", "--distill-coef", str(coef)]
    student_args += (["--distill-with-reward"] if with_reward else
                     ["--group-size", "1", "--groups-per-step", str(tasks_per_step)])
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as work:
        work = Path(work)
        data, adapters = work / "data", work / "adapters"
        with LocalServer(data) as server:
            rl_summary = train(server.url, "rl", work / "rl", steps)
            student_summary = train(server.url, "student", work / "student", steps, *student_args)
        rl, student = client_curve(rl_summary), client_curve(student_summary)
        result: dict[str, Any] = {
            "task": "demo", "model": "artisan-tiny (embedded)", "steps": steps, "coef": coef, "with_reward": with_reward,
            "student_episodes_per_step": tasks_per_step if not with_reward else None,
            "teacher_final_reward": rl[-1][2],
            "rl_from_scratch_seconds_to_teacher_reward": seconds_to(rl, rl[-1][2], rl[-1][3]),
            "distilled_seconds_to_teacher_reward": seconds_to(student, rl[-1][2], rl[-1][3]),
            "rl_curve_step_seconds_reward_se": rl, "distilled_curve_step_seconds_reward_se": student}

        base = greedy_point(0, 0.0, None, eval_tasks)
        greedy = {"rl": [base, *artisan_greedy(data, "rl", rl_summary, adapters, eval_tasks, greedy_every)],
                  "artisan_student": [base, *artisan_greedy(data, "student", student_summary, adapters, eval_tasks,
                                                               greedy_every)]}
        if trl:
            from distill_trl import DIFFERENCES, item_distinct_steps, run_trl_distill

            root = data / "runs" / "rl"
            teacher = export_peft(root / "checkpoints", steps, root / "run.json", adapters / "teacher")
            saved = run_trl_distill(DEFAULT_MODEL_DIR, teacher, item_distinct_steps(steps, tasks_per_step, seed=0),
                                    learning_rate=student_summary["history"][0]["learning_rate"],
                                    temperature=SETTINGS.temperature, max_turns=SETTINGS.max_turns,
                                    max_tokens_per_turn=SETTINGS.max_tokens, seed=0, out=work / "trl",
                                    save_every=greedy_every)
            greedy["trl_student"] = [base, *(greedy_point(s["step"], s["train_seconds"], s["adapter"], eval_tasks)
                                             for s in saved)]
            result["trl_differences"] = DIFFERENCES
        target, target_se = greedy["rl"][-1][2], greedy["rl"][-1][3]
        result["greedy"] = {"teacher_reward": target, "curves_step_seconds_reward_se": greedy,
                            "seconds_to_teacher_reward": {k: seconds_to(v, target, target_se) for k, v in greedy.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
