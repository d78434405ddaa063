"""`python -m client.train`: train an agent on an example against an art-server, end to end.

Evaluates on held-out tasks before training and every `--eval-every` steps, trains, resumes from
the run's current step when restarted, prints one line per step, and writes `summary.json` and
`reward.png` to `--out`. After `--patience` attempts in a row that trained nothing it stops with
exit status 3 and says why (client/patience.py). Errors are one line (client/errors.py). Never
imports torch: this runs on a laptop.

The loop is client/pipeline.py's: with `--max-steps-off-policy 0` (the default) it samples a
batch, trains it, and samples the next from the new step; with S > 0, rollouts go on while a step
trains, from the newest step, and no group trains more than S steps stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import pkgutil
import random
import re
import sys
import time
import typing
from pathlib import Path
from typing import Any, Awaitable, Literal, get_args

import typer
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from client.apo import NothingToRegress, ValueTable
from client.curriculum import Curriculum, next_level, success_rate
from client.decline import best_eval, entropy_collapse, first_entropy, held_out_decline, keep_best_line, stderr_of
from client.errors import ConfigError, cli_errors, validation_line
from client.gather import TooManyExceptions, gather_trajectory_groups
from client.model import TrainableModel, check_server_url
from client.outage import watch_for
from client.patience import Patience, attempt_record, failed_rollouts_record
from client.report import (StepTiming, curriculum_part, domain_lines, figure, interrupted_line,  # noqa: F401
                           nothing_to_train_line, retry_line, run_line, step_line)
from client.pipeline import Journal, Pipeline
from client.ray_rollouts import RayRolloutPool, RayWorkers, check_ray_address
from protocol.config import MODULE_NAME, Baseline, LossName, RunSpec, TrainConfig
from protocol.domains import DOMAIN_KEY, domain_figures
from protocol.jobs import TrainResult
from protocol.trajectory import Trajectory, TrajectoryGroup
from rollouts.env import Example, Task
from rollouts.seeding import derive_seed, seeded

app = typer.Typer(add_completion=False)


class LoopConfig(BaseModel):
    """One run of the loop: where, what, how long, and how each step trains."""

    server: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    run: str = "demo-run"
    project: str = "default"
    example: str = "demo"
    steps: int = Field(default=20, ge=0)
    groups_per_step: int = Field(default=8, ge=1)
    group_size: int = Field(default=8, ge=1)
    eval_every: int = Field(default=5, ge=0)
    eval_tasks: int = Field(default=64, ge=1)
    # Attempts in a row that may train nothing before the loop gives up (see client/patience.py).
    patience: int = Field(default=3, ge=1)
    # Steps a group's sampler may be behind the weights that train it (client/pipeline.py); 0 is
    # synchronous: no sampling while a step trains.
    max_steps_off_policy: int = Field(default=0, ge=0, le=64)
    # How long each call waits out an unreachable server (a restart) before the run gives up; None:
    # ARTISAN_RETRY_SECONDS, else 300 (client/model.py).
    retry_seconds: float | None = Field(default=None, ge=0)
    # Seeds the task draws and every rollout's and evaluation's sampling (rollouts/seeding.py), so
    # that the same command gives the same curve; None: tasks drawn from 0, sampling unseeded.
    seed: int | None = None
    out: Path = Path("out/train")
    reward: Literal["env", "ruler"] = "env"
    judge: str | None = None
    progress: bool = True
    train: TrainConfig = TrainConfig()
    # Overrides of the example's rollout settings (max_turns, max_tokens, temperature); None keeps its own.
    rollout_overrides: dict[str, Any] = {}
    # Raise the example's difficulty level as its held-out success passes a threshold (client/curriculum.py).
    curriculum: Curriculum | None = None
    start_level: int = Field(default=0, ge=0)
    # A*-PO's stage 1 (client/apo.py), for a TrainConfig whose baseline is "given" (loss "apo").
    value_samples: int = Field(default=8, ge=1, le=1024)
    value_beta: float = Field(default=0.5, gt=0)
    skip_unsolved: bool = True
    # The example's own options, passed to its make_example (`--domain retail --domain airline`).
    example_kwargs: dict[str, Any] = {}
    # Run rollouts (training, evaluation, A*-PO's reference samples) on Ray workers; None: here.
    ray: RayWorkers | None = None
    # At the end, if an earlier step scored higher on held-out tasks than the latest, the run's name
    # serves that step (PUT /v1/runs/{name}/serving); training still goes on from the latest.
    keep_best: bool = False

    @property
    def task_seed(self) -> int:
        """The seed the training tasks are drawn from: an unseeded run draws the tasks of seed 0."""
        return 0 if self.seed is None else self.seed


def example_names() -> list[str]:
    """The short names `--example` takes: the packages under examples/ that define make_example."""
    spec = importlib.util.find_spec("examples")  # found by name: the client does not import examples/
    names = []
    for info in pkgutil.iter_modules(spec.submodule_search_locations if spec else []):
        try:
            if info.ispkg and hasattr(importlib.import_module(f"examples.{info.name}"), "make_example"):
                names.append(info.name)
        except Exception:  # an example that cannot be imported here is not one to offer
            continue
    return sorted(names)


def load_example(name: str, **kwargs: Any) -> Example:
    """An example by short name (`demo`, `retail`) or by module path (`my_pkg.my_task`); the
    module must define `make_example(**kwargs) -> Example`."""
    module_name = name if "." in name else f"examples.{name}"

    def unknown() -> ConfigError:
        return ConfigError(f"--example {name!r}: no such example; the examples are {', '.join(example_names())}, "
                           f"or give the module path of your own that defines make_example()")

    if not re.match(MODULE_NAME, name):
        raise unknown()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the module asked for is unknown; a missing dependency inside it is its own error.
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise unknown() from None
        raise
    if not hasattr(module, "make_example"):
        raise ConfigError(f"--example {name!r}: module {module_name} defines no make_example()")
    accepted = inspect.signature(module.make_example).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    for key in kwargs:
        if not takes_any and key not in accepted:
            offered = [f"--{k.replace('_', '-')}" for k, p in accepted.items() if p.kind is p.KEYWORD_ONLY
                       or p.kind is p.POSITIONAL_OR_KEYWORD]
            raise ConfigError(f"--{key.replace('_', '-')}: no such option"
                              + (f"; --example {name} takes {', '.join(offered)}" if offered else
                                 f" (--example {name} takes none of its own)"))
    try:
        return module.make_example(**typed_options(module.make_example, kwargs))
    except TypeError as exc:  # make_example(**kwargs) passing them on to a constructor that refuses one
        if kwargs and "unexpected keyword argument" in str(exc):
            raise ConfigError(f"--example {name}: {exc}") from None
        raise


def typed_options(make_example: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`options` as the example declares them, by make_example's parameters or, for the ones it
    passes on (`**kwargs`), by the fields of the dataclass it returns: the command line gives
    strings ("0.3", "8"). An option declared nowhere is passed as it is."""
    try:
        hints = typing.get_type_hints(make_example)
        made = hints.pop("return", None)
        declared = typing.get_type_hints(made) if dataclasses.is_dataclass(made) else {}
    except (NameError, TypeError):  # annotations that do not resolve: nothing to convert by
        return options
    params = inspect.signature(make_example).parameters
    declared.update({k: v for k, v in hints.items() if params[k].kind is not inspect.Parameter.VAR_KEYWORD})
    out = {}
    for key, value in options.items():
        if key not in declared:
            out[key] = value
            continue
        try:
            out[key] = TypeAdapter(declared[key]).validate_python(value)
        except ValidationError as exc:
            raise ConfigError(f"--{key.replace('_', '-')} {value!r}: {exc.errors()[0]['msg']}") from None
    return out


def example_options(args: list[str]) -> dict[str, Any]:
    """The command line's options that client.train does not know, for the example's make_example:
    `--name value` (repeated: a list), `--flag` alone: True. Dashes become underscores."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: options are --name value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = True  # type: ignore[assignment]
        key = key.replace("-", "_")
        if key in out:
            out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
        else:
            out[key] = value
        i += 1
    return out


async def run_groups(model: TrainableModel, example: Example, tasks: list[Task], group_size: int,
                     hook=None, progress: bool = True, description: str = "rollouts", policy: str | None = None,
                     max_exceptions: int | float = 0.5, workers: RayRolloutPool | None = None,
                     seed: int | None = None) -> list[TrajectoryGroup]:
    """`policy`: the served name to sample from (`run@step`); the run's latest step by default.
    `workers`: run the rollouts on these Ray workers instead of here. `seed`: every rollout's calls
    are seeded from it (the k-th rollout of the i-th task from derive_seed(seed, i, k)); None: unseeded."""
    policy = policy or model.name
    # One client per batch, closed when the batch is done: an unclosed client's connections can
    # leave a later batch's responses unread until they time out.
    async with contextlib.nullcontext() if workers else model.openai_client(max_retries=0, timeout=120) as client:
        def one(i: int, k: int, t: Task) -> Awaitable[Trajectory]:  # made anew for each try
            return workers.rollout(policy, t) if workers else \
                seeded(example.rollout(client, policy, t), None if seed is None else derive_seed(seed, i, k))

        # A rollout (or a judgment) cut off by a server restart runs again once it is back (client/outage.py).
        watch = watch_for(model)
        groups = [[watch.run(functools.partial(one, i, k, t)) for k in range(group_size)] for i, t in enumerate(tasks)]
        scored = None if hook is None else lambda g: watch.run(lambda: hook(g))
        try:
            gathered = await gather_trajectory_groups(groups, progress=progress, after_each=scored,
                                                      description=description, max_exceptions=max_exceptions)
        except TooManyExceptions:
            if watch.gone is not None:  # the server did not come back within the retry window
                raise watch.gone from None
            raise
        if watch.gone is not None:
            raise watch.gone
    # A group is one task's rollouts: it carries the task's domain, so that its failed rollouts are
    # counted against that domain too (protocol/domains.py).
    for g, t in zip(gathered, tasks):
        if DOMAIN_KEY in t.metadata:
            g.metadata.setdefault(DOMAIN_KEY, t.metadata[DOMAIN_KEY])
    return gathered


async def _one_group(model: TrainableModel, example: Example, task: Task, n: int, policy: str,
                     workers: RayRolloutPool | None = None) -> TrajectoryGroup:
    """`n` rollouts of one task from `policy` (A*-PO's reference samples: the base model)."""
    return (await run_groups(model, example, [task], n, progress=False, description="reference", policy=policy,
                             max_exceptions=1.0, workers=workers))[0]


def mean_reward(groups: list[TrajectoryGroup]) -> float | None:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards) if rewards else None


async def evaluate(model: TrainableModel, example: Example, tasks: list[Task], progress: bool,
                   step: int | None = None, by_domain: dict[str, Any] | None = None,
                   workers: RayRolloutPool | None = None, seed: int | None = None,
                   rewards: list[float] | None = None) -> float | None:
    """Held-out reward of step `step` (the latest by default), logged as that step's. `by_domain`,
    if given, receives the reward per domain of tasks that name one; `rewards`, each task's reward
    (a task whose rollout failed has none). `seed`: as run_groups'."""
    policy = None if step is None else f"{model.name}@{step}"
    groups = await run_groups(model, example, tasks, 1, progress=progress, description="eval", policy=policy,
                              workers=workers, seed=seed)
    await model.log(groups, split="val", step=step)
    if by_domain is not None:
        by_domain.update({d: f["reward_mean"] for d, f in domain_figures(groups).items()})
    if rewards is not None:
        rewards.extend(mean_reward([g]) for g in groups if g.trajectories)
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


MAX_UNSOLVED_DRAWS = 64  # A*-PO: prompts in a row no reference sample solved before the run stops


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
                   "evals": self.evals, "history": self.history}
        self.path.write_text(json.dumps(summary, indent=2))
        return summary


RUNS_AT: dict[str, dict[str, Any]] = {}  # run name -> its step, and whether a batch is at the server


def _marking(hook: Any, marks: dict[str, float]) -> Any:
    """`hook`, noting in `marks` when a group's rollouts ended and its scoring began."""
    if hook is None:
        return None

    async def scored(group: TrajectoryGroup) -> TrajectoryGroup:
        marks["rollouts_done"] = time.monotonic()
        return await hook(group)

    return scored


def group_hook(cfg: LoopConfig, example: Example, model: TrainableModel):
    """What scores a training group after its rollouts: RULER alone with `--reward ruler`, else the
    example's own group scorer (with `--judge`, or art-server's base model as the judge), if it has one."""
    from rewards.ruler import JudgeConfig, ruler_hook

    if cfg.reward == "ruler":
        return ruler_hook(cfg.judge)
    judge = JudgeConfig.parse(cfg.judge) if cfg.judge else None if model.base_model is None else \
        JudgeConfig(model=model.base_model, base_url=cfg.server.rstrip("/") + "/v1", api_key=cfg.api_key, backend="openai")
    return example.group_scorer(judge)


async def train_loop(cfg: LoopConfig, example: Example | None = None) -> dict[str, Any]:
    """The run `cfg` describes; `example` is an Example object to train instead of `cfg.example`'s."""
    example = example or load_example(cfg.example, **cfg.example_kwargs)
    for key, value in cfg.rollout_overrides.items():
        if value is not None:
            setattr(example.settings, key, value)
    if cfg.reward == "ruler" and not cfg.judge:
        raise ConfigError("--reward ruler needs --judge (a litellm model or http://host/v1#model)")
    if cfg.start_level >= example.levels() or (cfg.curriculum and example.levels() < 2):
        raise ConfigError(f"example {example.name!r} has {example.levels()} difficulty level(s): "
                          + ("--curriculum needs two or more" if cfg.curriculum else
                             f"--start-level {cfg.start_level} is past its last ({example.levels() - 1})"))
    example.level = cfg.start_level
    if cfg.ray is not None:
        check_ray_address(cfg.ray.address)
    model = await TrainableModel(cfg.run, project=cfg.project, retry_seconds=cfg.retry_seconds).register(
        cfg.server, cfg.api_key)
    async with model.lease():  # one client trains a run at a time: a second is refused here, in one line
        return await _with_run(cfg, example, model)


async def _with_run(cfg: LoopConfig, example: Example, model: TrainableModel) -> dict[str, Any]:
    # The judge scores groups here, on the driver, once their rollouts are back.
    hook = group_hook(cfg, example, model)
    if cfg.train.baseline == "given" and hook is not None:
        raise ConfigError("A*-PO (--loss apo) needs an absolute reward for V*(x), and this run's groups are scored by "
                          "a judge that ranks a group against itself (--reward ruler, or the example's own): use "
                          "--reward env and an example without a group judge")
    if cfg.ray is None:
        return await _train_loop(cfg, example, model, hook, None)
    workers = await RayRolloutPool(cfg.ray, example, model.server_url, cfg.api_key, cfg.run).start()
    print(workers.describe(), flush=True)
    try:
        return await _train_loop(cfg, example, model, hook, workers)
    finally:
        workers.close()


async def _train_loop(cfg: LoopConfig, example: Example, model: TrainableModel, hook: Any,
                      workers: RayRolloutPool | None) -> dict[str, Any]:
    apo = cfg.train.baseline == "given"
    cfg.out.mkdir(parents=True, exist_ok=True)
    held_out = example.eval_tasks()[: cfg.eval_tasks]  # the starting level's: before and after compare
    rng, drawn = random.Random(cfg.task_seed), []
    summary = Summary(cfg.out / "summary.json", cfg.run, resumed_at=model.step)
    summary.rollout_workers = workers.figures if workers else None
    train_cfg = cfg.train.model_copy(update={"max_steps_off_policy": cfg.max_steps_off_policy})
    # The task source: its level moves with the curriculum; a resumed run takes the level it reached.
    source = {"tasks": example.train_tasks(cfg.task_seed), "success": None}
    if cfg.curriculum and summary.history:
        last = next((h for h in reversed(summary.history) if h.get("curriculum_level") is not None), None)
        if last is not None:
            example.level = last.get("level_after", last["curriculum_level"])
            source["success"] = last.get("level_success") if example.level == last["curriculum_level"] else None
            source["tasks"] = example.train_tasks(cfg.task_seed)
    values = ValueTable(cfg.value_samples, cfg.value_beta, cfg.skip_unsolved) if apo else None
    reference = model.base_model if apo else None
    where = RUNS_AT[cfg.run] = {"step": model.step, "in_flight": False}  # what main says on Ctrl-C
    default_lr = (await model.request("GET", f"/v1/runs/{model.name}")).get("default_learning_rate")
    print(run_line(cfg.run, bool(model.created), model.step, cfg.steps, model.base_model,
                   cfg.train.learning_rate or default_lr, cfg.groups_per_step, cfg.group_size, cfg.train.loss), flush=True)
    if model.step >= cfg.steps:
        print(nothing_to_train_line(cfg.run, model.step, cfg.steps), flush=True)
    # When each sampled group's rollouts ended and it was scored (monotonic clock), by id: the step line's split.
    group_times: dict[int, tuple[float, float]] = {}
    clock: dict[str, float | None] = {"submitted": None, "train": None}

    async def eval_now() -> None:
        step, by_domain, rewards = model.step, {}, []
        reward = await evaluate(model, example, held_out, cfg.progress, step, by_domain, workers,
                                seed=None if cfg.seed is None else derive_seed(cfg.seed, "eval", step), rewards=rewards)
        summary.evals.append({"step": step, "reward": reward, "stderr": stderr_of(rewards),
                              "wall_seconds": time.time() - summary.started,
                              **({"by_domain": by_domain} if by_domain else {})})
        domains = ", ".join(f"{d} {figure(r)}" for d, r in by_domain.items())
        fell = held_out_decline(summary.evals, cfg.run, cfg.train.learning_rate or default_lr, cfg.keep_best)
        said = "-" if reward is None else f"{reward:.3f}"
        print(f"eval @ step {step}: reward {said}" + (f" ({domains})" if domains else "")
              + (f"\n  warning: {fell}" if fell else ""), flush=True)

    async def check_level(step: int) -> None:
        """TinyZero's rule: the current level's held-out success, and one level up past the threshold."""
        cur = cfg.curriculum
        tasks = example.eval_tasks()[: cur.eval_tasks]
        # The step has trained: a check whose rollouts all failed measures nothing and moves nothing.
        groups = await run_groups(model, example, tasks, 1, progress=cfg.progress, description="level check",
                                  policy=f"{model.name}@{step}", max_exceptions=1.0, workers=workers)
        success = success_rate([t.reward for g in groups for t in g.trajectories], cur.success_at)
        level = next_level(example.level, success, cur.threshold, example.levels())
        print(f"curriculum @ step {step}: level {example.level} held-out success "
              f"{'none (every rollout failed)' if success is None else f'{success:.2f}'}"
              + (f" >= {cur.threshold}: level {level}" if level != example.level else ""), flush=True)
        source["success"] = None if level != example.level else success
        if level != example.level:
            example.level = level
            source["tasks"] = example.train_tasks(cfg.task_seed)

    async def sample(policy: str, index: int) -> TrajectoryGroup:
        # Tasks in the order groups start, from the seed: a synchronous run draws the tasks it always drew.
        while len(drawn) <= index:
            tasks = source["tasks"]
            drawn.append(tasks[rng.randrange(len(tasks))])
        task, value = drawn[index], None
        if values is not None:
            for _ in range(MAX_UNSOLVED_DRAWS):
                key = f"{task.metadata.get('level', 0)}/{task.id}"
                est = await values.get(key, lambda n, t=task: _one_group(model, example, t, n, reference, workers))
                if not est.usable:  # every reference sample failed: this draw's rollouts failed
                    return TrajectoryGroup(exceptions=list(est.errors), metadata=dict(task.metadata))
                if values.trainable(est):
                    value = est.value
                    break
                tasks = source["tasks"]
                task = tasks[rng.randrange(len(tasks))]
            else:
                raise NothingToRegress(MAX_UNSOLVED_DRAWS, cfg.value_samples)
        marks: dict[str, float] = {}
        groups = await run_groups(model, example, [task], cfg.group_size, _marking(hook, marks), progress=False,
                                  policy=policy, max_exceptions=1.0, workers=workers,
                                  seed=None if cfg.seed is None else derive_seed(cfg.seed, "train", policy.rpartition("@")[2], index))
        group = groups[0]
        scored = time.monotonic()
        group_times[id(group)] = (marks.get("rollouts_done", scored), scored)
        group.value = value
        if cfg.curriculum:
            for t in group.trajectories:
                t.metrics["curriculum_level"] = task.metadata.get("level", example.level)
        return group

    if not summary.evals:
        await eval_now()
    patience = Patience(cfg.patience)
    async def train_batch(groups: list[TrajectoryGroup], key: str) -> TrainResult:
        clock["submitted"], where["in_flight"] = time.monotonic(), True
        result = await model.train(groups, train_cfg, idempotency_key=key)
        clock["train"] = time.monotonic() - clock["submitted"]
        where.update(step=model.step, in_flight=False)
        # Checked before the pipeline hears of the new step, so that (synchronously) the next
        # step's groups are drawn at the level this check decides.
        if cfg.curriculum and result.trained and cfg.curriculum.due(result.step):
            await check_level(result.step)
        return result

    pipeline = Pipeline(sample, train_batch,
                        run=model.name, served_step=model.step, groups_per_step=cfg.groups_per_step,
                        max_steps_off_policy=cfg.max_steps_off_policy, journal=Journal(cfg.out / "pending"),
                        retain=model.retain_adapters)
    # A step with nothing to train does not advance the run: patience ends a streak of those.
    begun = time.monotonic()
    try:
        async with contextlib.aclosing(pipeline.steps(cfg.steps)) as outcomes:
            async for outcome in outcomes:
                timing = StepTiming.measure(
                    begun, time.monotonic(), [t for g in outcome.groups if (t := group_times.pop(id(g), None))],
                    clock["submitted"] if outcome.result is not None else None, clock["train"],
                    outcome.result.metrics.queue_seconds if outcome.result is not None else None)
                clock.update(submitted=None, train=None)
                level = example.level
                if outcome.error is not None:  # an outage may pass: counted as an attempt, not fatal at once
                    attempt = failed_rollouts_record(model.step, outcome.error)
                    print(f"step {model.step + 1:3d} not trained | {outcome.error}", flush=True)
                else:
                    result = outcome.result
                    attempt = attempt_record(outcome.groups, result)
                    levels = [t.metrics.get("curriculum_level") for g in outcome.groups for t in g.trajectories]
                    level = max((x for x in levels if x is not None), default=level)
                    extra = curriculum_part(level, source["success"] if level == example.level else None) \
                        if cfg.curriculum else ""
                    m = result.metrics
                    collapsing = entropy_collapse(first_entropy(summary.history), result.step, m.entropy, m.reward_mean,
                                                  m.groups_constant_solved, m.groups_total) if result.trained else None
                    if collapsing:
                        attempt["entropy_collapse"] = collapsing
                    print(step_line(result, extra, timing) + (f"\n  warning: {collapsing}" if collapsing else ""),
                          flush=True)
                    if (result.trained and cfg.eval_every and result.step % cfg.eval_every == 0
                            and result.step < cfg.steps):
                        await eval_now()
                if cfg.curriculum:
                    # The level this attempt's rollouts were drawn at, and the success last measured there.
                    attempt["curriculum_level"] = level
                    attempt["level_success"] = source["success"] if level == example.level else None
                    attempt["level_after"] = example.level
                if values is not None:
                    attempt.update(values.figures())
                judged = judge_figures(outcome.groups)
                if judged:
                    attempt["judge"] = judged
                    print(judge_line(judged), flush=True)
                attempt["wall_seconds"] = time.time() - summary.started
                attempt["timing"] = timing.figures()
                summary.history.append(attempt)
                patience.record(attempt)
                # Held-out 0 at step 0 and a first batch of nothing but 0: more attempts would only cost time.
                hopeless = patience.hopeless(model.step, [e["reward"] for e in summary.evals if e["step"] == 0])
                if patience.exhausted or hopeless:
                    verdict = patience.verdict(model.step, cfg.group_size, where=str(summary.path),
                                               eval_rewards=tuple(e["reward"] for e in summary.evals), early=hopeless)
                    summary.write(stopped={"cause": verdict.cause, "attempts": len(patience.streak),
                                           "message": str(verdict)})
                    plot(summary.history, summary.evals, cfg.out / "reward.png")
                    raise verdict
                if not attempt["trained"]:
                    print(retry_line(len(patience.streak), cfg.patience, model.step), flush=True)
                summary.write()
                begun = time.monotonic()  # the next attempt's time starts here (after any evaluation)
    except NothingToRegress as exc:  # A*-PO found no prompt the base model ever solves: said, and kept
        summary.write(stopped={"cause": exc.cause, "message": str(exc),
                               **(values.figures() if values is not None else {})})
        plot(summary.history, summary.evals, cfg.out / "reward.png")
        raise
    if summary.evals[-1]["step"] != model.step:
        await eval_now()
    if cfg.keep_best:
        await serve_best(model, summary)
    plot(summary.history, summary.evals, cfg.out / "reward.png")
    return summary.write()


async def serve_best(model: TrainableModel, summary: Summary) -> None:
    """--keep-best: the run's name serves the best evaluated step when it is not the latest (the
    server unpins it when the run trains its next step); the latest again when it is the best."""
    best, latest = best_eval(summary.evals), summary.evals[-1]
    if best is None or latest.get("reward") is None:
        return
    pinned = best["step"] != latest["step"]
    answer = await model.request("PUT", f"/v1/runs/{model.name}/serving",
                                 json={"step": best["step"] if pinned else None})
    summary.keep_best = {"serving_step": answer["serving_step"], "reward": best["reward"],
                         "latest_step": latest["step"], "latest_reward": latest["reward"]}
    print(keep_best_line(model.name, best, latest) if pinned else
          f"--keep-best: step {latest['step']} scored best on held-out ({latest['reward']:.3f}); run {model.name} "
          f"serves it", flush=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def main(
    ctx: typer.Context,
    server: str = typer.Option("http://127.0.0.1:8000", help="art-server base URL"),
    api_key: str = typer.Option(None, envvar="ARTISAN_API_KEY"),
    run: str = typer.Option("demo-run", help="Run name (created if new, resumed if it exists)."),
    project: str = typer.Option("default"),
    example: str = typer.Option("demo", help="An example's name or a module path defining make_example(); "
                                              "options this command does not know go to it (--domain retail)."),
    steps: int = typer.Option(20, help="Train until the run reaches this step."),
    groups_per_step: int = typer.Option(8),
    group_size: int = typer.Option(8),
    learning_rate: float = typer.Option(None, help="Default: derived from the model (see TrainConfig)."),
    loss: str = typer.Option("ppo", help="ppo, cispo, importance_sampling, awr (TinyZero's advantage-weighted SFT) "
                                         "or apo (A*-PO, Brantley et al. 2025: V*(x) from --value-samples of the "
                                         "base model, then least-squares regression; use --group-size 1)"),
    baseline: str = typer.Option(None, help="group_mean (GRPO, the default), leave_one_out (RLOO: REINFORCE with "
                                            "a baseline; with --loss importance_sampling) or given (V*(x) of "
                                            "A*-PO's stage 1; the default with --loss apo)"),
    apo_beta: float = typer.Option(1e-3, help="A*-PO's beta_2: beta * log pi/pi_ref is regressed on r - V*(x)."),
    value_samples: int = typer.Option(8, help="A*-PO's stage 1: base-model samples per prompt to estimate V*(x)."),
    value_beta: float = typer.Option(0.5, help="A*-PO's beta_1: V* = beta * log mean exp(r / beta)."),
    keep_unsolved: bool = typer.Option(False, help="A*-PO: also train prompts no reference sample solved "
                                                   "(skipped and counted by default, as the paper does)."),
    curriculum: float = typer.Option(None, help="Raise the example's difficulty level when held-out success of "
                                                "the current level reaches this fraction (TinyZero's curriculum)."),
    curriculum_every: int = typer.Option(25, help="Steps between the curriculum's held-out checks."),
    curriculum_eval_tasks: int = typer.Option(32, help="Held-out tasks of the current level per check."),
    start_level: int = typer.Option(0, help="The difficulty level to start at (examples with levels)."),
    num_minibatches: int = typer.Option(1, help="Optimizer steps per epoch over each batch of rollouts."),
    epochs: int = typer.Option(1, help="Passes over each batch of rollouts (the clipped loss keeps them safe)."),
    eval_every: int = typer.Option(5),
    eval_tasks: int = typer.Option(64),
    seed: int = typer.Option(None, help="Seed the task draws and the server's sampling of every rollout and "
                                        "evaluation: the same command gives the same curve [default: tasks from "
                                        "0, sampling unseeded]."),
    out: Path = typer.Option(Path("out/train")),
    reward: str = typer.Option("env", help="env (the environment's reward) or ruler (an LLM judge ranks each group)"),
    judge: str = typer.Option(None, help="The judge of --reward ruler, or of an example that judges its groups (default "
                                                 "there: art-server's base model): a litellm model string or "
                                                 "http://host:port/v1#model"),
    max_turns: int = typer.Option(None, help="Override the example's turns per rollout."),
    max_tokens: int = typer.Option(None, help="Override the example's tokens per model turn."),
    temperature: float = typer.Option(None, help="Override the example's sampling temperature."),
    progress: bool = typer.Option(True, help="Show progress bars."),
    patience: int = typer.Option(3, help="Stop, with exit status 3 and the cause, after this many attempts in a "
                                         "row that trained nothing (e.g. every rollout scored the same)."),
    max_steps_off_policy: int = typer.Option(0, help="Keep sampling while a step trains, from the newest step, "
                                                     "with no group trained more than this many steps stale "
                                                     "(0: synchronous)."),
    retry_seconds: float = typer.Option(None, envvar="ARTISAN_RETRY_SECONDS",
                                        help="How long a call waits out an unreachable server (a restart) before "
                                             "the run gives up [default: 300]."),
    ray_address: str = typer.Option(None, help="Run rollouts on this Ray cluster's nodes (ray://host:10001 or "
                                               "host:6379), in a pool of workers; the judge stays here."),
    ray_workers: int = typer.Option(None, help="Rollout workers on the Ray cluster, 1 CPU each [default: 2]."),
    ray_worker_concurrency: int = typer.Option(None, help="Rollouts one Ray worker runs at once [default: 32]."),
    debug: bool = typer.Option(False, "--debug", envvar="ARTISAN_DEBUG",
                               help="Show the full traceback of an error (also ARTISAN_DEBUG=1)."),
    keep_best: bool = typer.Option(False, help="At the end, if an earlier evaluated step scored higher on held-out "
                                               "tasks than the latest, serve it under the run's name (the next "
                                               "trained step, from the latest weights, serves again)."),
) -> None:
    with cli_errors(debug):
        cfg = loop_config(server=server, api_key=api_key, run=run, project=project, example=example, steps=steps,
                          groups_per_step=groups_per_step, group_size=group_size, eval_every=eval_every,
                          eval_tasks=eval_tasks, seed=seed, out=out, reward=reward, judge=judge, progress=progress,
                          patience=patience, max_steps_off_policy=max_steps_off_policy,
                          retry_seconds=retry_seconds,
                          train={"learning_rate": learning_rate, "loss": loss, "num_minibatches": num_minibatches,
                                 "epochs": epochs, "baseline": baseline, "apo_beta": apo_beta},
                          curriculum=None if curriculum is None else {
                              "threshold": curriculum, "every": curriculum_every, "eval_tasks": curriculum_eval_tasks},
                          start_level=start_level, value_samples=value_samples, value_beta=value_beta,
                          skip_unsolved=not keep_unsolved,
                          rollout_overrides={"max_turns": max_turns, "max_tokens": max_tokens,
                                             "temperature": temperature},
                          example_kwargs=example_options(list(ctx.args)),
                          ray=ray_options(ray_address, ray_workers, ray_worker_concurrency), keep_best=keep_best)
        try:
            summary = asyncio.run(train_loop(cfg, load_example(cfg.example, **cfg.example_kwargs)))
        except KeyboardInterrupt:  # Ctrl-C: how to go on, not a traceback; 130 as a shell's 128 + SIGINT
            at = RUNS_AT.get(cfg.run)
            print(interrupted_line(at and at["step"], bool(at and at["in_flight"])), file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        print(json.dumps({k: summary[k] for k in ("eval_reward_before", "eval_reward_after", "steps", "seconds", "judge")
                          if k in summary}))


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
