"""`python -m client.train`: train an agent on an example against an art-server, end to end.

Evaluates on held-out tasks before training and every `--eval-every` steps, trains, resumes from
the run's current step when restarted, prints one line per step, and writes `summary.json` and
`reward.png` to `--out`. Never imports torch: this runs on a laptop.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import typer

from client.gather import gather_trajectory_groups
from client.model import TrainableModel
from client.types import TrainConfig, TrajectoryGroup
from rollouts.agent import rollout
from rollouts.env import Example, Task

app = typer.Typer(add_completion=False)


def load_example(name: str, **kwargs: Any) -> Example:
    """An example by short name (`demo`, `retail`) or by module path (`my_pkg.my_task`); the
    module must define `make_example(**kwargs) -> Example`."""
    module = importlib.import_module(name if "." in name else f"examples.{name}")
    return module.make_example(**kwargs)


async def run_groups(model: TrainableModel, example: Example, tasks: list[Task], group_size: int,
                     hook=None, progress: bool = True, description: str = "rollouts") -> list[TrajectoryGroup]:
    # Closed when the batch is done. With one unclosed client per batch, a later batch's rollouts
    # sometimes waited two minutes (to the request timeout) on responses that sat unread in their
    # sockets' buffers: in 3 of 3 demo runs before this change, in none of 5 after.
    async with model.openai_client(max_retries=0, timeout=120) as client:
        groups = [[rollout(client, model.name, example.make_env(t), t, example.settings) for _ in range(group_size)]
                  for t in tasks]
        return await gather_trajectory_groups(groups, progress=progress, after_each=hook, description=description)


def mean_reward(groups: list[TrajectoryGroup]) -> float | None:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else None


async def evaluate(model: TrainableModel, example: Example, tasks: list[Task], progress: bool) -> float | None:
    groups = await run_groups(model, example, tasks, 1, progress=progress, description="eval")
    await model.log(groups, split="val")
    return mean_reward(groups)


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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def train_loop(server: str, api_key: str | None, run: str, project: str, example_name: str, steps: int,
                     groups_per_step: int, group_size: int, learning_rate: float | None, loss: str,
                     num_minibatches: int, epochs: int,
                     eval_every: int, eval_tasks: int, seed: int, out: Path, reward: str, judge: str | None,
                     progress: bool = True, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    example = load_example(example_name)
    for key, value in (overrides or {}).items():
        if value is not None:
            setattr(example.settings, key, value)
    hook = None
    if reward == "ruler":
        if not judge:
            raise typer.BadParameter("--reward ruler needs --judge (a litellm model or http://host/v1#model)")
        from rewards.ruler import ruler_hook

        hook = ruler_hook(judge)
    model = await TrainableModel(run, project=project).register(server, api_key)
    held_out = example.eval_tasks()[:eval_tasks]
    train_tasks = example.train_tasks(seed)
    rng = random.Random(seed)
    state_path = out / "summary.json"
    previous = json.loads(state_path.read_text()) if state_path.exists() else {}
    history: list[dict[str, Any]] = previous.get("history", []) if previous.get("run") == run else []
    evals: list[dict[str, Any]] = previous.get("evals", []) if previous.get("run") == run else []
    config = TrainConfig(learning_rate=learning_rate, loss=loss, num_minibatches=num_minibatches, epochs=epochs)

    if not evals:
        before = await evaluate(model, example, held_out, progress)
        evals.append({"step": model.step, "reward": before})
        print(f"eval @ step {model.step}: reward {before:.3f}", flush=True)
    attempts = 0
    while model.step < steps and attempts < 3 * steps:
        attempts += 1
        tasks = [train_tasks[rng.randrange(len(train_tasks))] for _ in range(groups_per_step)]
        groups = await run_groups(model, example, tasks, group_size, hook, progress, f"step {model.step + 1}")
        result = await model.train(groups, config)
        m = result.metrics
        history.append({"step": result.step, "trained": result.trained, **m, "warnings": result.warnings})
        gap = m.get("logprob_gap")
        print(f"step {result.step:3d} | reward {m.get('reward_mean', 0):.3f} | groups {m.get('groups_trainable', 0)}/"
              f"{m.get('groups_total', 0)} trainable, {m.get('groups_dropped_constant', 0)} dropped | "
              f"exceptions {m.get('trajectories_excluded', 0)} | logprob_gap "
              f"{gap if gap is None else f'{gap:.1e}'} | {m.get('step_seconds', 0):.1f}s"
              + "".join(f"\n  warning: {w}" for w in result.warnings), flush=True)
        if result.trained and eval_every and result.step % eval_every == 0 and result.step < steps:
            r = await evaluate(model, example, held_out, progress)
            evals.append({"step": result.step, "reward": r})
            print(f"eval @ step {result.step}: reward {r:.3f}", flush=True)
        _write(state_path, run, evals, history, started, previous)
    if evals[-1]["step"] != model.step:
        r = await evaluate(model, example, held_out, progress)
        evals.append({"step": model.step, "reward": r})
        print(f"eval @ step {model.step}: reward {r:.3f}", flush=True)
    summary = _write(state_path, run, evals, history, started, previous)
    plot(history, evals, out / "reward.png")
    return summary


def _write(path: Path, run: str, evals, history, started: float, previous: dict[str, Any]) -> dict[str, Any]:
    summary = {
        "run": run,
        "eval_reward_before": evals[0]["reward"],
        "eval_reward_after": evals[-1]["reward"],
        "steps": history[-1]["step"] if history else evals[-1]["step"],
        "seconds": previous.get("seconds", 0.0) + (time.time() - started) if previous.get("run") == run
        else time.time() - started,
        "evals": evals,
        "history": history,
    }
    path.write_text(json.dumps(summary, indent=2))
    return summary


@app.command()
def main(
    server: str = typer.Option("http://127.0.0.1:8000", help="art-server base URL"),
    api_key: str = typer.Option(None, envvar="ARTISAN_API_KEY"),
    run: str = typer.Option("demo-run", help="Run name (created if new, resumed if it exists)."),
    project: str = typer.Option("default"),
    example: str = typer.Option("demo", help="An example's name or a module path defining make_example()."),
    steps: int = typer.Option(20, help="Train until the run reaches this step."),
    groups_per_step: int = typer.Option(8),
    group_size: int = typer.Option(8),
    learning_rate: float = typer.Option(None, help="Default: derived from the model's size (see TrainConfig)."),
    loss: str = typer.Option("ppo", help="ppo, cispo, importance_sampling or awr"),
    num_minibatches: int = typer.Option(1, help="Optimizer steps per epoch over each batch of rollouts."),
    epochs: int = typer.Option(1, help="Passes over each batch of rollouts (the clipped loss keeps them safe)."),
    eval_every: int = typer.Option(5),
    eval_tasks: int = typer.Option(64),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("out/train")),
    reward: str = typer.Option("env", help="env (the environment's reward) or ruler (an LLM judge ranks each group)"),
    judge: str = typer.Option(None, help="For --reward ruler: a litellm model string or http://host:port/v1#model"),
    max_turns: int = typer.Option(None, help="Override the example's turns per rollout."),
    max_tokens: int = typer.Option(None, help="Override the example's tokens per model turn."),
    temperature: float = typer.Option(None, help="Override the example's sampling temperature."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    overrides = {"max_turns": max_turns, "max_tokens": max_tokens, "temperature": temperature}
    summary = asyncio.run(train_loop(server, api_key, run, project, example, steps, groups_per_step, group_size,
                                     learning_rate, loss, num_minibatches, epochs, eval_every, eval_tasks, seed, out, reward, judge, progress,
                                     overrides))
    print(json.dumps({k: summary[k] for k in ("eval_reward_before", "eval_reward_after", "steps", "seconds")}))


if __name__ == "__main__":
    app()
