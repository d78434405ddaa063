"""`python -m client.train`: train an agent on an example against an art-server, end to end.

Evaluates on held-out tasks before training and every `--eval-every` steps, trains, resumes from
the run's current step when restarted, prints one line per step, and writes `summary.json` and
`reward.png` to `--out`. After `--patience` attempts in a row that trained nothing it stops with
exit status 3 and says why (client/loop/patience.py). Errors are one line (client/errors.py). Never
imports torch: this runs on a laptop.

This module is the command line; the loop is client/loop/training_loop.py's, on client/pipeline.py: with
`--max-steps-off-policy 0` (the default) it samples a batch, trains it, and samples the next from
the new step; with S > 0, rollouts go on while a step trains, from the newest step, and no group
trains more than S steps stale.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, get_args

import typer
from pydantic import ValidationError

from client.loop.curriculum import Curriculum
from client.errors import ConfigError, cli_errors, validation_line
from client.loop.examples import example_options, load_example
from client.loop.interrupt import run_interruptible
from client.loop.team_loop import team_loop
from client.loop.training_loop import RUNS_AT, train_loop
from client.loop.config import LoopConfig, WarmStart
from client.loop.ray_rollouts import RayWorkers
from client.model import DEFAULT_RETRY_SECONDS, check_server_url
from client.loop.report import interrupted_line
from protocol.config import Baseline, Distill, LossName, RunSpec, TrainConfig
from rollouts.team import TeamExample

app = typer.Typer(add_completion=False)


def default(config: type, name: str) -> Any:
    """Field `name`'s default in a config (a pydantic model or a dataclass): the command line's
    defaults are LoopConfig's and its parts', written there alone."""
    if dataclasses.is_dataclass(config):
        return next(f.default for f in dataclasses.fields(config) if f.name == name)
    return config.model_fields[name].get_default(call_default_factory=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    server: str = typer.Option(default(LoopConfig, "server"), help="art-server base URL"),
    api_key: str = typer.Option(default(LoopConfig, "api_key"), envvar="ARTISAN_API_KEY"),
    run: str = typer.Option(default(LoopConfig, "run"), help="Run name (created if new, resumed if it exists)."),
    project: str = typer.Option(default(LoopConfig, "project")),
    example: str = typer.Option(default(LoopConfig, "example"), help="An example's name or a module path defining "
                                "make_example(); options this command does not know go to it (--domain retail)."),
    steps: int = typer.Option(default(LoopConfig, "steps"), help="Train until the run reaches this step."),
    groups_per_step: int = typer.Option(default(LoopConfig, "groups_per_step")),
    group_size: int = typer.Option(default(LoopConfig, "group_size")),
    learning_rate: float = typer.Option(default(TrainConfig, "learning_rate"),
                                        help="Default: derived from the model (see TrainConfig)."),
    loss: str = typer.Option(default(TrainConfig, "loss"), help="ppo, cispo, importance_sampling, awr (TinyZero's "
                             "advantage-weighted SFT) or apo (A*-PO, Brantley et al. 2025: V*(x) from --value-samples "
                             "of the base model, then least-squares regression; use --group-size 1)"),
    baseline: str = typer.Option(default(TrainConfig, "baseline"), help="group_mean (GRPO, the default), "
                                 "leave_one_out (RLOO: REINFORCE with a baseline; with --loss importance_sampling) or "
                                 "given (V*(x) of A*-PO's stage 1; the default with --loss apo)"),
    apo_beta: float = typer.Option(default(TrainConfig, "apo_beta"), help="A*-PO's beta_2: beta * log pi/pi_ref is "
                                   "regressed on r - V*(x)."),
    value_samples: int = typer.Option(default(LoopConfig, "value_samples"), help="A*-PO's stage 1: base-model "
                                      "samples per prompt to estimate V*(x)."),
    value_beta: float = typer.Option(default(LoopConfig, "value_beta"), help="A*-PO's beta_1: V* = beta * log mean "
                                     "exp(r / beta)."),
    keep_unsolved: bool = typer.Option(not default(LoopConfig, "skip_unsolved"), help="A*-PO: also train prompts no "
                                       "reference sample solved (skipped and counted by default, as the paper does)."),
    curriculum: float = typer.Option(default(LoopConfig, "curriculum"), help="Raise the example's difficulty level "
                                     "when held-out success of the current level reaches this fraction (TinyZero's "
                                     "curriculum)."),
    curriculum_every: int = typer.Option(default(Curriculum, "every"),
                                         help="Steps between the curriculum's held-out checks."),
    curriculum_eval_tasks: int = typer.Option(default(Curriculum, "eval_tasks"),
                                              help="Held-out tasks of the current level per check."),
    start_level: int = typer.Option(default(LoopConfig, "start_level"),
                                    help="The difficulty level to start at (examples with levels)."),
    num_minibatches: int = typer.Option(default(TrainConfig, "num_minibatches"),
                                        help="Optimizer steps per epoch over each batch of rollouts."),
    epochs: int = typer.Option(default(TrainConfig, "epochs"), help="Passes over each batch of rollouts (the clipped "
                               "loss keeps them safe)."),
    eval_every: int = typer.Option(default(LoopConfig, "eval_every")),
    eval_tasks: int = typer.Option(default(LoopConfig, "eval_tasks")),
    seed: int = typer.Option(default(LoopConfig, "seed"), help="Seed the task draws and the server's sampling of "
                             "every rollout and evaluation: the same command gives the same curve [default: tasks "
                             "from 0, sampling unseeded]."),
    out: Path = typer.Option(default(LoopConfig, "out")),
    reward: str = typer.Option(default(LoopConfig, "reward"), help="env (the environment's reward) or ruler (an LLM "
                               "judge ranks each group)"),
    judge: str = typer.Option(default(LoopConfig, "judge"), help="The judge of --reward ruler, or of an example that "
                              "judges its groups (default there: art-server's base model): a litellm model string or "
                              "http://host:port/v1#model"),
    # None keeps the example's own rollout settings.
    max_turns: int = typer.Option(None, help="Override the example's turns per rollout."),
    max_tokens: int = typer.Option(None, help="Override the example's tokens per model turn."),
    temperature: float = typer.Option(None, help="Override the example's sampling temperature."),
    progress: bool = typer.Option(default(LoopConfig, "progress"), help="Show progress bars."),
    patience: int = typer.Option(default(LoopConfig, "patience"), help="Stop, with exit status 3 and the cause, after "
                                 "this many attempts in a row that trained nothing (e.g. every rollout scored the "
                                 "same)."),
    dynamic_sampling: int = typer.Option(default(LoopConfig, "dynamic_sampling"), help="DAPO's dynamic sampling: "
                                         "up to this many groups a step are sampled in place of groups whose "
                                         "rollouts all scored alike, so that a step trains on groups with signal "
                                         "(0: off)."),
    max_steps_off_policy: int = typer.Option(default(LoopConfig, "max_steps_off_policy"), help="Keep sampling while a "
                                             "step trains, from the newest step, with no group trained more than "
                                             "this many steps stale (0: synchronous)."),
    retry_seconds: float = typer.Option(default(LoopConfig, "retry_seconds"), envvar="ARTISAN_RETRY_SECONDS",
                                        help="How long a call waits out an unreachable server (a restart) before "
                                             f"the run gives up [default: {DEFAULT_RETRY_SECONDS:g}]."),
    ray_address: str = typer.Option(None, help="Run rollouts on this Ray cluster's nodes (ray://host:10001 or "
                                               "host:6379), in a pool of workers; the judge stays here."),
    # None: RayWorkers' own defaults, which the help shows.
    ray_workers: int = typer.Option(None, help="Rollout workers on the Ray cluster, 1 CPU each "
                                               f"[default: {default(RayWorkers, 'workers')}]."),
    ray_worker_concurrency: int = typer.Option(None, help="Rollouts one Ray worker runs at once "
                                                          f"[default: {default(RayWorkers, 'concurrency')}]."),
    debug: bool = typer.Option(False, "--debug", envvar="ARTISAN_DEBUG",
                               help="Show the full traceback of an error (also ARTISAN_DEBUG=1)."),
    warm_start: int = typer.Option(default(LoopConfig, "warm_start"), help="A new run first trains art-server's SFT "
                                   "job on this many of the example's demonstrations (its step 1), then GRPO from "
                                   "there."),
    warm_start_epochs: int = typer.Option(default(WarmStart, "epochs"), help="Passes over the --warm-start "
                                          "demonstrations."),
    warm_start_learning_rate: float = typer.Option(default(WarmStart, "learning_rate"), help="The --warm-start SFT "
                                                   "job's learning rate [default: the server's for the model]."),
    teacher: str = typer.Option(None, help="On-policy distillation: a model the server serves (its base model, a run "
                                "or run@step) scores every sampled token, and the student learns from the per-token "
                                "reverse KL to it; rewards are not read unless --distill-with-reward."),
    distill_coef: float = typer.Option(default(Distill, "coef"), help="The --teacher KL advantage's weight."),
    distill_with_reward: bool = typer.Option(default(Distill, "with_reward"), help="Add the reward's group-relative "
                                             "advantage to the --teacher KL's."),
    train_roles: str = typer.Option(None, help="A multi-agent example (its roles each train a run, "
                                    "{--run}-{role}, at one step boundary): the roles to train, comma-separated "
                                    "[default: every role]; the others sample from where they are."),
    keep_best: bool = typer.Option(default(LoopConfig, "keep_best"), help="At the end, if an earlier evaluated step "
                                   "scored higher on held-out tasks than the latest, serve it under the run's name "
                                   "(the next trained step, from the latest weights, serves again)."),
) -> None:
    with cli_errors(debug):
        cfg = loop_config(**config_options(ctx.params, list(ctx.args)))
        try:
            example = load_example(cfg.example, **cfg.example_kwargs)
            summary = run_interruptible(team_loop(cfg, example) if isinstance(example, TeamExample)
                                        else train_loop(cfg, example))
        except KeyboardInterrupt:  # Ctrl-C: how to go on, not a traceback; 130 as a shell's 128 + SIGINT
            at = RUNS_AT.get(cfg.run)
            print(interrupted_line(at and at["step"], bool(at and at["in_flight"])), file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        print(json.dumps({k: summary[k] for k in ("eval_reward_before", "eval_reward_after", "steps", "seconds", "judge")
                          if k in summary}))


def config_options(o: dict[str, Any], example_args: list[str]) -> dict[str, Any]:
    """The parsed command line as loop_config's keywords: LoopConfig's fields, with the options of
    its parts (train, curriculum, ray, warm_start) gathered into them."""
    return dict(server=o["server"], api_key=o["api_key"], run=o["run"], project=o["project"], example=o["example"],
                steps=o["steps"], groups_per_step=o["groups_per_step"], group_size=o["group_size"],
                eval_every=o["eval_every"], eval_tasks=o["eval_tasks"], seed=o["seed"], out=o["out"],
                reward=o["reward"], judge=o["judge"], progress=o["progress"], patience=o["patience"],
                max_steps_off_policy=o["max_steps_off_policy"], retry_seconds=o["retry_seconds"],
                dynamic_sampling=o["dynamic_sampling"],
                train={"learning_rate": o["learning_rate"], "loss": o["loss"], "num_minibatches": o["num_minibatches"],
                       "epochs": o["epochs"], "baseline": o["baseline"], "apo_beta": o["apo_beta"],
                       "distill": None if o["teacher"] is None else {
                           "teacher": o["teacher"], "coef": o["distill_coef"], "with_reward": o["distill_with_reward"]}},
                curriculum=None if o["curriculum"] is None else {
                    "threshold": o["curriculum"], "every": o["curriculum_every"],
                    "eval_tasks": o["curriculum_eval_tasks"]},
                start_level=o["start_level"], value_samples=o["value_samples"], value_beta=o["value_beta"],
                skip_unsolved=not o["keep_unsolved"],
                rollout_overrides={"max_turns": o["max_turns"], "max_tokens": o["max_tokens"],
                                   "temperature": o["temperature"]},
                example_kwargs=example_options(example_args),
                ray=ray_options(o["ray_address"], o["ray_workers"], o["ray_worker_concurrency"]),
                keep_best=o["keep_best"],
                train_roles=None if o["train_roles"] is None else [r.strip() for r in o["train_roles"].split(",")],
                warm_start=None if o["warm_start"] is None else {
                    "demonstrations": o["warm_start"], "epochs": o["warm_start_epochs"],
                    "learning_rate": o["warm_start_learning_rate"]})


def ray_options(address: str | None, workers: int | None, concurrency: int | None) -> dict[str, Any] | None:
    """The Ray flags as RayWorkers' fields; None (rollouts run here) without --ray-address."""
    if address is None:
        if workers is not None or concurrency is not None:
            raise ConfigError("--ray-workers and --ray-worker-concurrency need --ray-address")
        return None
    given = {"workers": workers, "concurrency": concurrency}
    return {"address": address, **{k: v for k, v in given.items() if v is not None}}


def loop_config(**options: Any) -> LoopConfig:
    """The command line's options as a LoopConfig; an option that cannot work is a ConfigError
    naming it, before anything is started."""
    losses = get_args(LossName)
    baselines = get_args(Baseline)
    if options["train"].get("baseline") not in (None, *baselines):
        raise ConfigError(f"--baseline {options['train']['baseline']!r}: use {', '.join(baselines)}")
    if options["train"]["loss"] not in losses:
        raise ConfigError(f"--loss {options['train']['loss']!r} is not a loss: use {', '.join(losses)}. GRPO's "
                          f"group-relative advantages are used with every loss (ppo, the default, is GRPO with "
                          f"PPO's clipped objective).")
    rewards = get_args(LoopConfig.model_fields["reward"].annotation)
    if options["reward"] not in rewards:
        raise ConfigError(f"--reward {options['reward']!r}: use env (the environment's own reward) or ruler (an "
                          f"LLM judge ranks each group; needs --judge)")
    check_server_url(options["server"], "--server")
    try:
        RunSpec(name=options["run"], project=options["project"])
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--run" if err["loc"][0] == "name" else "--project"
        raise ConfigError(f"{flag} {err['input']!r} is not a valid name: 1-64 letters, digits, '_', '-' or '.', "
                          f"starting with a letter or digit") from None
    if options.get("curriculum") is not None:
        try:
            options["curriculum"] = Curriculum(**options["curriculum"])
        except ValueError as exc:
            raise ConfigError(f"--curriculum: {exc}") from None
    try:
        return LoopConfig(**options)
    except ValidationError as exc:
        raise ConfigError(validation_line(exc, {"name": "--run", "address": "--ray-address", "workers": "--ray-workers",
                                                "concurrency": "--ray-worker-concurrency"})) from None


if __name__ == "__main__":
    app()
