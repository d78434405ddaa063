"""The training loop: sample, train (client/pipeline.py), evaluate and record, up to the run's last step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from functools import partial
from typing import Any

from client.loop.apo import NothingToRegress, ValueTable
from client.loop.curriculum import next_level, success_rate
from client.loop.decline import (best_eval, entropy_collapse, first_entropy, held_out_decline, keep_best_line,
                                no_held_out_gain, one_answer, training_reward_decline)
from client.errors import ConfigError
from client.loop.evaluation import eval_line, eval_record, eval_seed, evaluate_on, measure_note
from client.loop.examples import load_example
from client.loop.config import LoopConfig
from client.model import TrainableModel
from client.loop.patience import Patience, attempt_record, failed_rollouts_record, set_aside_record
from client.pipeline import Journal, Pipeline, StepOutcome
from client.loop.ray_rollouts import check_ray_address
from client.loop.report import (StepTiming, curriculum_part, nothing_to_train_line, retry_line, run_line,
                                set_aside_part, step_line, warm_start_line)
from client.loop.rollout_source import RolloutSource, rollout_source
from client.loop.summary import Summary, judge_figures, judge_line, plot
from client.loop.task_draws import TaskDraws
from protocol.config import SFTConfig
from protocol.jobs import TrainResult
from protocol.names import policy_name, split_policy
from protocol.trajectory import TrajectoryGroup, rewards_differ
from rollouts.env import Example, Task
from rollouts.seeding import derive_seed

MAX_UNSOLVED_DRAWS = 64  # A*-PO: prompts in a row no reference sample solved before the run stops

RUNS_AT: dict[str, dict[str, Any]] = {}  # run name -> its step, and whether a batch is at the server


def _marking(hook: Any, marks: dict[str, float]) -> Any:
    """`hook`, noting in `marks` when a group's rollouts ended and its scoring began."""
    if hook is None:
        return None

    async def scored(group: TrajectoryGroup) -> TrajectoryGroup:
        marks["rollouts_done"] = time.monotonic()
        return await hook(group)

    return scored


def scored_alike(group: TrajectoryGroup, min_spread: float) -> bool:
    """Dynamic sampling sets such a group aside: its rollouts all scored alike, so it would train
    nothing. A group with failed rollouts goes to the server, which counts them."""
    return not group.exceptions and not rewards_differ([t.reward for t in group.trajectories], min_spread)


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
    if cfg.train_roles:
        raise ConfigError(f"--train-roles: example {example.name!r} has one agent; roles are a multi-agent "
                          f"example's (rollouts/team.py)")
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
    if cfg.dynamic_sampling and (cfg.group_size < 2 or cfg.train.baseline == "given" or cfg.train.distill):
        raise ConfigError("--dynamic-sampling replaces groups whose rollouts all scored alike, which carry no signal "
                          "for a group baseline: it needs --group-size 2 or more, and neither --loss apo nor --teacher")
    if cfg.warm_start and type(example).demonstrations is Example.demonstrations:
        raise ConfigError(f"--warm-start: example {example.name!r} has no demonstrations to train on "
                          f"(an Example's demonstrations(n) makes them)")
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
    rollouts = await rollout_source(cfg, example, model)
    try:
        return await TrainingLoop(cfg, example, model, hook, rollouts).run()
    finally:
        rollouts.close()


class TrainingLoop:
    """One run of `cfg` on a registered, leased model. A step with nothing to train does not advance
    the run: patience (client/loop/patience.py) ends a streak of those."""

    def __init__(self, cfg: LoopConfig, example: Example, model: TrainableModel, hook: Any,
                 rollouts: RolloutSource):
        self.cfg, self.example, self.model, self.hook, self.rollouts = cfg, example, model, hook, rollouts
        apo = cfg.train.baseline == "given"
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.held_out = example.eval_tasks()[: cfg.eval_tasks]  # the starting level's: before and after compare
        self.measure_said = False  # the first evaluation line says what held-out reward measures
        self.drawn: list[Task] = []  # the pipeline's groups' tasks, by index
        self.summary = Summary(cfg.out / "summary.json", cfg.run, resumed_at=model.step)
        self.summary.rollout_workers = rollouts.figures
        self.train_cfg = cfg.train.model_copy(update={"max_steps_off_policy": cfg.max_steps_off_policy})
        # The task source: its level moves with the curriculum; a resumed run takes the level it reached.
        self.draws = TaskDraws(example.train_tasks(cfg.task_seed), cfg.task_seed)
        self.level_success: float | None = None  # the current level's last held-out success
        if cfg.curriculum and self.summary.history:
            self.resume_level()
        self.draws.skip(self.summary.resumed_draws)
        self.summary.draws = self.draws
        self.values = ValueTable(cfg.value_samples, cfg.value_beta, cfg.skip_unsolved) if apo else None
        self.reference = model.base_model if apo else None
        self.where = RUNS_AT[cfg.run] = {"step": model.step, "in_flight": False}  # what main says on Ctrl-C
        self.learning_rate: float | None = cfg.train.learning_rate
        # When each sampled group's rollouts ended and it was scored (monotonic clock), by id: the step line's split.
        self.group_times: dict[int, tuple[float, float]] = {}
        self.submitted: float | None = None  # when the step now training was sent
        self.train_seconds: float | None = None  # how long the last step took at the server
        # A step the server answered whose record is not in the summary yet (Ctrl-C may come between).
        self.unrecorded: tuple[list[TrajectoryGroup], TrainResult] | None = None
        self.patience = Patience(cfg.patience)

    async def run(self) -> dict[str, Any]:
        """Train to `cfg.steps`; the summary as written."""
        cfg, summary = self.cfg, self.summary
        await self.announce()
        if not summary.evals:
            await self.eval_now()
        if cfg.warm_start and self.model.step == 0 < cfg.steps:
            await self.warm_start()
        pipeline = Pipeline(self.sample, self.train_batch,
                            run=self.model.name, served_step=self.model.step, groups_per_step=cfg.groups_per_step,
                            max_steps_off_policy=cfg.max_steps_off_policy, journal=Journal(cfg.out / "pending"),
                            retain=self.model.retain_adapters,
                            set_aside=partial(scored_alike, min_spread=cfg.train.min_group_reward_spread)
                            if cfg.dynamic_sampling else None,
                            max_set_aside=cfg.dynamic_sampling)
        begun = time.monotonic()
        try:
            async with contextlib.aclosing(pipeline.steps(cfg.steps)) as outcomes:
                async for outcome in outcomes:
                    attempt = await self.record(outcome, begun)
                    self.give_up_if_stuck()
                    if not attempt["trained"]:
                        print(retry_line(len(self.patience.streak), cfg.patience, self.model.step), flush=True)
                    summary.write()
                    begun = time.monotonic()  # the next attempt's time starts here (after any evaluation)
        except NothingToRegress as exc:  # A*-PO found no prompt the base model ever solves: said, and kept
            self.stop(cause=exc.cause, message=str(exc), **(self.values.figures() if self.values is not None else {}))
            raise
        except asyncio.CancelledError:  # Ctrl-C: the summary has every step the server trained
            if self.unrecorded is not None:
                summary.history.append({**attempt_record(*self.unrecorded), "interrupted": True,
                                        "wall_seconds": time.time() - summary.started})
                summary.write()
            raise
        return await self.finish()

    def resume_level(self) -> None:
        """A resumed curriculum run: the level it reached, and the success last measured there."""
        last = next((h for h in reversed(self.summary.history) if h.get("curriculum_level") is not None), None)
        if last is not None:
            self.example.level = last.get("level_after", last["curriculum_level"])
            self.level_success = last.get("level_success") if self.example.level == last["curriculum_level"] else None
            self.draws.replace(self.example.train_tasks(self.cfg.task_seed))

    async def announce(self) -> None:
        """The run's first line (and that there is nothing to train, when there is not)."""
        cfg, model = self.cfg, self.model
        default_lr = (await model.request("GET", f"/v1/runs/{model.name}")).get("default_learning_rate")
        self.learning_rate = cfg.train.learning_rate or default_lr
        d = cfg.train.distill
        loss = cfg.train.loss if d is None else \
            f"{cfg.train.loss}, distilled from {d.teacher} (coef {d.coef:g}{', with the reward' if d.with_reward else ''})"
        print(run_line(cfg.run, bool(model.created), model.step, cfg.steps, model.base_model, self.learning_rate,
                       cfg.groups_per_step, cfg.group_size, loss), flush=True)
        if model.step >= cfg.steps:
            print(nothing_to_train_line(cfg.run, model.step, cfg.steps), flush=True)

    async def warm_start(self) -> None:
        """--warm-start: SFT on the example's demonstrations as the run's first step, and its
        evaluation, the start that GRPO's gain is measured from. A resumed run is past it."""
        ws, started = self.cfg.warm_start, time.monotonic()
        demos = self.example.demonstrations(ws.demonstrations)
        result = await self.model.train_sft(demos, SFTConfig(epochs=ws.epochs, learning_rate=ws.learning_rate),
                                            idempotency_key=f"{self.cfg.run}:warm-start")
        self.summary.warm_start = {"step": result.step, "demonstrations": len(demos), "epochs": ws.epochs,
                                   "loss": result.metrics.loss, "grad_norm": result.metrics.grad_norm,
                                   "lora_update_norm": result.metrics.lora_update_norm}
        self.where["step"] = result.step
        print(warm_start_line(result, len(demos), ws.epochs, time.monotonic() - started), flush=True)
        await self.eval_now()

    async def eval_now(self) -> None:
        """Evaluate the latest step on the held-out tasks: recorded, and said with any decline or lack of gain."""
        cfg, step, by_domain, rewards, replies = self.cfg, self.model.step, {}, [], []
        reward = await evaluate_on(self.rollouts, self.held_out, cfg.progress, step, by_domain,
                                   seed=eval_seed(cfg.seed, step), rewards=rewards, replies=replies)
        self.summary.evals.append(eval_record(step, reward, rewards, by_domain, self.summary.started))
        evals, warm = self.summary.evals, self.summary.warm_start
        warnings = [w for w in (held_out_decline(evals, cfg.run, self.learning_rate, cfg.keep_best),
                                no_held_out_gain(evals, warm["step"] if warm else 0, cfg.steps, self.summary.history,
                                                 self.learning_rate),
                                one_answer(replies, reward)) if w]
        if warnings:
            evals[-1]["warnings"] = warnings  # summary.json keeps what the line said
        note = None if self.measure_said else measure_note(len(self.held_out), self.example.settings.temperature)
        self.measure_said = True
        print(eval_line(step, reward, by_domain, warnings, note), flush=True)

    async def check_level(self, step: int) -> None:
        """TinyZero's rule: the current level's held-out success, and one level up past the threshold."""
        cur, example = self.cfg.curriculum, self.example
        tasks = example.eval_tasks()[: cur.eval_tasks]
        # The step has trained: a check whose rollouts all failed measures nothing and moves nothing.
        groups = await self.rollouts.run_groups(tasks, 1, progress=self.cfg.progress, description="level check",
                                                policy=policy_name(self.model.name, step), max_exceptions=1.0)
        success = success_rate([t.reward for g in groups for t in g.trajectories], cur.success_at)
        level = next_level(example.level, success, cur.threshold, example.levels())
        print(f"curriculum @ step {step}: level {example.level} held-out success "
              f"{'none (every rollout failed)' if success is None else f'{success:.2f}'}"
              + (f" >= {cur.threshold}: level {level}" if level != example.level else ""), flush=True)
        self.level_success = None if level != example.level else success
        if level != example.level:
            example.level = level
            self.draws.replace(example.train_tasks(self.cfg.task_seed))

    def draw(self) -> Task:
        """A training task of the current level, by the run's seeded draw."""
        return self.draws.next()

    async def reference_value(self, task: Task) -> tuple[Task, Any]:
        """A*-PO: the first task, from `task` on, whose V*(x) estimate can train, and that estimate;
        an unusable estimate (every reference sample failed) ends the search at once."""
        for _ in range(MAX_UNSOLVED_DRAWS):
            key = f"{task.metadata.get('level', 0)}/{task.id}"
            est = await self.values.get(key, lambda n, t=task: self.rollouts.one_group(t, n, self.reference))
            if not est.usable or self.values.trainable(est):
                return task, est
            task = self.draw()
        raise NothingToRegress(MAX_UNSOLVED_DRAWS, self.cfg.value_samples)

    async def sample(self, policy: str, index: int) -> TrajectoryGroup:
        """The pipeline's `index`-th group, from `policy`."""
        cfg = self.cfg
        # Tasks in the order groups start, from the seed: a synchronous run draws the tasks it always drew.
        while len(self.drawn) <= index:
            self.drawn.append(self.draw())
        task, value = self.drawn[index], None
        if self.values is not None:
            task, est = await self.reference_value(task)
            if not est.usable:  # every reference sample failed: this draw's rollouts failed
                return TrajectoryGroup(exceptions=list(est.errors), metadata=dict(task.metadata))
            value = est.value
        marks: dict[str, float] = {}
        seed = None if cfg.seed is None else derive_seed(cfg.seed, "train", split_policy(policy)[1], index)
        groups = await self.rollouts.run_groups([task], cfg.group_size, _marking(self.hook, marks), progress=False,
                                                policy=policy, max_exceptions=1.0, seed=seed)
        group = groups[0]
        scored = time.monotonic()
        self.group_times[id(group)] = (marks.get("rollouts_done", scored), scored)
        group.value = value
        if cfg.curriculum:
            for t in group.trajectories:
                t.metrics["curriculum_level"] = task.metadata.get("level", self.example.level)
        return group

    async def train_batch(self, groups: list[TrajectoryGroup], key: str) -> TrainResult:
        """The pipeline's step: `groups` trained at the server."""
        self.submitted, self.where["in_flight"] = time.monotonic(), True
        result = await self.model.train(groups, self.train_cfg, idempotency_key=key)
        self.train_seconds = time.monotonic() - self.submitted
        self.where.update(step=self.model.step, in_flight=False)
        self.unrecorded = (groups, result)
        # Checked before the pipeline hears of the new step, so that (synchronously) the next
        # step's groups are drawn at the level this check decides.
        if self.cfg.curriculum and result.trained and self.cfg.curriculum.due(result.step):
            await self.check_level(result.step)
        return result

    def timing(self, outcome: StepOutcome, begun: float) -> StepTiming:
        """Where the attempt's time went; the clock of the step it trained is then reset."""
        trained = outcome.result is not None
        timing = StepTiming.measure(
            begun, time.monotonic(), [t for g in outcome.groups if (t := self.group_times.pop(id(g), None))],
            self.submitted if trained else None, self.train_seconds,
            outcome.result.metrics.queue_seconds if trained else None)
        self.submitted = self.train_seconds = None
        return timing

    async def trained_attempt(self, result: TrainResult, groups: list[TrajectoryGroup], timing: StepTiming,
                              set_aside: list[TrajectoryGroup]) -> tuple[dict[str, Any], int]:
        """A step the server answered: its record and the level its rollouts were drawn at, its line
        said, and the held-out evaluation when one is due."""
        cfg, example = self.cfg, self.example
        attempt = attempt_record(groups, result)
        levels = [t.metrics.get("curriculum_level") for g in groups for t in g.trajectories]
        level = max((x for x in levels if x is not None), default=example.level)
        extra = curriculum_part(level, self.level_success if level == example.level else None) \
            if cfg.curriculum else ""
        if cfg.dynamic_sampling:
            attempt |= set_aside_record(groups, set_aside)
            extra += set_aside_part(len(set_aside))
        m = result.metrics
        collapsing = entropy_collapse(first_entropy(self.summary.history), result.step, m.entropy, m.reward_mean,
                                      m.groups_constant_solved, m.groups_total) if result.trained else None
        if collapsing:
            attempt["entropy_collapse"] = collapsing
        falling = training_reward_decline(self.batch_rewards(attempt))
        if falling:
            attempt["training_reward_decline"] = falling
        print(step_line(result, extra, timing) + "".join(f"\n  warning: {w}" for w in (collapsing, falling) if w),
              flush=True)
        if result.trained and cfg.eval_every and result.step % cfg.eval_every == 0 and result.step < cfg.steps:
            await self.eval_now()
        return attempt, level

    def batch_rewards(self, attempt: dict[str, Any]) -> list[tuple[int, float]]:
        """Every attempt's batch reward so far, this one last, each with the step its line names."""
        # Dynamic sampling keeps groups that scored alike out of the batch: the mean of all it sampled.
        return [(h["step"] if h["trained"] else h["step"] + 1, h.get("reward_mean_sampled", h["reward_mean"]))
                for h in (*self.summary.history, attempt) if h.get("reward_mean") is not None]

    async def record(self, outcome: StepOutcome, begun: float) -> dict[str, Any]:
        """One attempt, trained or not: said, and added to the summary's history and to patience."""
        timing = self.timing(outcome, begun)
        level = self.example.level
        if outcome.error is not None:  # an outage may pass: counted as an attempt, not fatal at once
            attempt = failed_rollouts_record(self.model.step, outcome.error)
            print(f"step {self.model.step + 1:3d} not trained | {outcome.error}", flush=True)
        else:
            attempt, level = await self.trained_attempt(outcome.result, outcome.groups, timing, outcome.set_aside)
        if self.cfg.curriculum:
            # The level this attempt's rollouts were drawn at, and the success last measured there.
            attempt["curriculum_level"] = level
            attempt["level_success"] = self.level_success if level == self.example.level else None
            attempt["level_after"] = self.example.level
        if self.values is not None:
            attempt.update(self.values.figures())
        judged = judge_figures(outcome.groups)
        if judged:
            attempt["judge"] = judged
            print(judge_line(judged), flush=True)
        attempt["wall_seconds"] = time.time() - self.summary.started
        attempt["timing"] = timing.figures()
        self.summary.history.append(attempt)
        self.unrecorded = None
        self.patience.record(attempt)
        return attempt

    def give_up_if_stuck(self) -> None:
        """Raise patience's verdict, recorded, after too many attempts that trained nothing, or at once
        when held-out 0 at step 0 and a first batch of nothing but 0 say more would only cost time."""
        patience, summary, step = self.patience, self.summary, self.model.step
        hopeless = patience.hopeless(step, [e["reward"] for e in summary.evals if e["step"] == 0])
        if patience.exhausted or hopeless:
            verdict = patience.verdict(step, self.cfg.group_size, where=str(summary.path),
                                       eval_rewards=tuple(e["reward"] for e in summary.evals), early=hopeless)
            self.stop(cause=verdict.cause, attempts=len(patience.streak), message=str(verdict))
            raise verdict

    def stop(self, **stopped: Any) -> None:
        """The record of a run that gives up before its last step: why, in summary.json, and its plot."""
        self.summary.write(stopped=stopped)
        plot(self.summary.history, self.summary.evals, self.cfg.out / "reward.png")

    async def finish(self) -> dict[str, Any]:
        """The last step evaluated, the best one served with --keep-best, the plot: the summary as written."""
        if self.summary.evals[-1]["step"] != self.model.step:
            await self.eval_now()
        if self.cfg.keep_best:
            await serve_best(self.model, self.summary)
        plot(self.summary.history, self.summary.evals, self.cfg.out / "reward.png")
        return self.summary.write()


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
