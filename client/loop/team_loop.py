"""`python -m client.train` on a multi-agent example (rollouts/team.py TeamExample): every role is a
run of its own (`{--run}-{role}`), sampled in the same episodes and trained at one step boundary.

Each step plays `--groups-per-step` tasks x `--group-size` episodes from every role's latest step,
splits them by role (client/team.py) and trains the roles named by `--train-roles` (all by default)
as one joint job; a role left out keeps sampling from where it is (the ablation that trains one).
Held-out evaluation plays one episode per task before training, every `--eval-every` steps and at
the end; the team's reward is the held-out reward, and each role's own figures are kept beside it.
The synchronous loop only: the single-run loop's options beyond that (Ray, a curriculum, A*-PO, a
teacher, a warm start, off-policy steps, a judge) are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from client.errors import ConfigError, RunCannotLearn
from client.loop.config import LoopConfig
from client.loop.decline import stderr_of
from client.loop.evaluation import eval_seed, mean_reward
from client.loop.report import figure
from client.loop.task_draws import TaskDraws
from client.model import TrainableModel
from client.team import team_groups, train_together
from protocol.names import policy_name
from protocol.trajectory import TrajectoryGroup
from rollouts.seeding import derive_seed
from rollouts.team import Seat, TeamExample

UNSUPPORTED = {"ray": "--ray-address", "curriculum": "--curriculum", "warm_start": "--warm-start",
               "judge": "--judge", "keep_best": "--keep-best", "dynamic_sampling": "--dynamic-sampling"}


def check_team_config(cfg: LoopConfig, example: TeamExample) -> list[str]:
    """The roles to train; a ConfigError for an option a team run does not take."""
    for field, flag in UNSUPPORTED.items():
        if getattr(cfg, field) not in (None, False):
            raise ConfigError(f"{flag}: example {example.name!r} is a multi-agent example, whose loop does not take it")
    if cfg.max_steps_off_policy or cfg.reward != "env" or cfg.train.distill is not None \
            or cfg.train.baseline == "given":
        raise ConfigError(f"example {example.name!r} is a multi-agent example: its loop is synchronous, with the "
                          f"environment's reward and GRPO's group baseline (no --max-steps-off-policy, --reward "
                          f"ruler, --teacher or --loss apo)")
    roles = cfg.train_roles or list(example.roles)
    unknown = [r for r in roles if r not in example.roles]
    if unknown:
        raise ConfigError(f"--train-roles {','.join(unknown)}: example {example.name!r} has roles "
                          f"{', '.join(example.roles)}")
    return roles


def role_figures(groups: list[TrajectoryGroup]) -> dict[str, Any]:
    """A role's reward over the episodes it acted in, and how many those were."""
    return {"reward": mean_reward(groups), "episodes": sum(len(g.trajectories) for g in groups)}


def step_line(record: dict[str, Any], trained: list[str]) -> str:
    """`step N | role reward R (its run's step, or why it did not move) | ... | time`."""
    parts = []
    for role, f in record["roles"].items():
        how = f"-> step {f['run_step']}" if f["trained"] else \
            "not trained: sampling only" if role not in trained else \
            f"not trained: its episodes scored alike in every group (stays at step {f['run_step']})"
        parts.append(f"{role} reward {figure(f['reward'])} over {f['episodes']} ({how})")
    return (f"team step {record['step']:3d} | " + " | ".join(parts)
            + f" | sampled {record['sample_seconds']:.0f}s, trained {record['train_seconds']:.0f}s")


class TeamLoop:
    def __init__(self, cfg: LoopConfig, example: TeamExample, models: dict[str, TrainableModel], trained: list[str]):
        self.cfg, self.example, self.models, self.trained = cfg, example, models, trained
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.held_out = example.eval_tasks()[: cfg.eval_tasks]
        self.draws = TaskDraws(example.train_tasks(cfg.task_seed), cfg.task_seed)
        self.started = time.time()
        self.summary: dict[str, Any] = {
            "example": example.name, "roles": {r: {"run": m.name, "trained": r in trained} for r, m in models.items()},
            "evals": [], "history": []}
        self.idle = 0  # attempts in a row that trained no role
        # One client per role for the whole run, closed at its end: an unclosed client's connections
        # can hold later responses unread (client/model.py).
        self.clients = {r: m.openai_client() for r, m in models.items()}

        # The team's step: attempts that stepped any trained role (a role whose groups all scored alike
        # in an attempt is not stepped, so the runs' own steps can differ); a resumed team goes on
        # from its furthest run.
        self.step = max(models[r].step for r in trained)

    def seats(self) -> dict[str, Seat]:
        return {r: Seat(self.clients[r], policy_name(m.name, m.step)) for r, m in self.models.items()}

    async def evaluate(self) -> None:
        """One episode per held-out task from every role's latest step: the team's reward (each
        episode's, whichever roles acted) and each role's, logged to each run as its evaluation."""
        groups = await team_groups(self.example, self.seats(), self.held_out, 1, eval_seed(self.cfg.seed, self.step),
                                   max_exceptions=1.0)
        team = [next((t.metrics["team_reward"] for r in groups for t in groups[r][i].trajectories), None)
                for i in range(len(self.held_out))]
        team = [r for r in team if r is not None]
        for role, model in self.models.items():
            acted = [g for g in groups[role] if g.trajectories or g.exceptions]
            if acted:
                await model.log(acted, split="val", step=model.step)
        record = {"step": self.step, "reward": sum(team) / len(team) if team else None, "stderr": stderr_of(team),
                  "roles": {r: role_figures(g) for r, g in groups.items()}, "wall_seconds": time.time() - self.started}
        self.summary["evals"].append(record)
        roles = ", ".join(f"{r} {figure(f['reward'])} over {f['episodes']}" for r, f in record["roles"].items())
        print(f"eval @ step {self.step}: team reward {figure(record['reward'])} ({roles})", flush=True)

    async def train_step(self) -> None:
        cfg, begun, attempt = self.cfg, time.monotonic(), self.step + 1
        tasks = [self.draws.next() for _ in range(cfg.groups_per_step)]
        seed = None if cfg.seed is None else derive_seed(cfg.seed, "train", self.step)
        groups = await team_groups(self.example, self.seats(), tasks, cfg.group_size, seed)
        sampled = time.monotonic() - begun
        results = await train_together({r: self.models[r] for r in self.trained}, {r: groups[r] for r in self.trained},
                                       cfg.train, idempotency_key=f"{cfg.run}:team-{attempt}-{uuid.uuid4().hex}")
        record = {"step": attempt, "sample_seconds": round(sampled, 2),
                  "train_seconds": round(time.monotonic() - begun - sampled, 2),
                  "roles": {r: {**role_figures(groups[r]), "trained": r in results and results[r].trained,
                                "run_step": self.models[r].step,
                                **({"loss": results[r].metrics.loss} if r in results else {})}
                            for r in self.models}}
        self.summary["history"].append(record)
        print(step_line(record, self.trained), flush=True)
        stepped = any(r.trained for r in results.values())
        self.step += stepped
        self.idle = 0 if stepped else self.idle + 1
        if self.idle >= cfg.patience:
            raise RunCannotLearn(f"{self.idle} attempts in a row trained no role: in every group, every episode "
                                 f"scored the same for each trained role (all 0: the task is out of reach from "
                                 f"these starts; all 1: nothing left to learn). Summary: {cfg.out / 'summary.json'}",
                                 cause="nothing_to_train")

    def write(self) -> dict[str, Any]:
        evals = self.summary["evals"]
        self.summary.update(eval_reward_before=evals[0]["reward"] if evals else None,
                            eval_reward_after=evals[-1]["reward"] if evals else None,
                            steps=self.step, seconds=round(time.time() - self.started, 1))
        (self.cfg.out / "summary.json").write_text(json.dumps(self.summary, indent=1))
        return self.summary

    async def run(self) -> dict[str, Any]:
        try:
            return await self._run()
        finally:
            for client in self.clients.values():
                await client.close()

    async def _run(self) -> dict[str, Any]:
        cfg, first = self.cfg, self.models[self.trained[0]]
        self.learning_rate = cfg.train.learning_rate or \
            (await first.request("GET", f"/v1/runs/{first.name}")).get("default_learning_rate")
        print(f"team {cfg.run} on example {self.example.name}: runs "
              + ", ".join(f"{r} {m.name} at step {m.step}" + ("" if r in self.trained else " (not trained)")
                          for r, m in self.models.items())
              + f"; training to team step {cfg.steps}, {cfg.groups_per_step} groups x {cfg.group_size} episodes, "
                f"learning rate {figure(self.learning_rate)}, loss {cfg.train.loss}", flush=True)
        await self.evaluate()
        while self.step < cfg.steps:
            await self.train_step()
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                await self.evaluate()
            self.write()
        if self.summary["evals"][-1]["step"] != self.step:
            await self.evaluate()
        return self.write()


async def team_loop(cfg: LoopConfig, example: TeamExample) -> dict[str, Any]:
    """Every role's run registered (created, or resumed where it is), then trained together to `cfg.steps`."""
    trained = check_team_config(cfg, example)
    for key, value in cfg.rollout_overrides.items():
        if value is not None:
            setattr(example.settings, key, value)
    models = {}
    for role in example.roles:
        models[role] = await TrainableModel(f"{cfg.run}-{role}", project=cfg.project,
                                            retry_seconds=cfg.retry_seconds).register(cfg.server, cfg.api_key)
    return await TeamLoop(cfg, example, models, trained).run()
