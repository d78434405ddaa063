"""Asynchronous training against synchronous, on a workload with an agent's latency.

The demo task on the embedded model, its environment slowed as agents' environments are: every
tool call takes 0.2-2 s (log-uniform), and scoring takes 0.2-0.5 s, except one episode in eight
whose scoring takes 4-8 s (a slow verifier, judge or sandbox): the long tail a synchronous step
waits for. For each seed, one run per bound S (0 = synchronous, then 1, 2, 4) trains through
`client.train`'s loop (the library API: `train_loop` with `max_steps_off_policy`), one run after
another on one art-server: the synchronous run `--steps` steps, each S > 0 run up to
`--async-steps-factor` times as many (staler steps may each teach less; time to reward is what
counts). The wall time at which each step landed is recorded during the run; afterwards, outside
the timed region, checkpoints are evaluated on 64 held-out tasks without the latency (the reward
is the same): each run's last, and every `--eval-every`-th in order until one reaches the target.

Time to reward: from a run's start (after its opening evaluation) to the landing of the first
evaluated step whose held-out reward reaches the synchronous run's final one, less one standard
error of a 64-task mean (so that evaluation noise does not decide it); each S's time is divided by
the synchronous run's own, seed by seed. Each run's reward at the synchronous run's wall time (its
newest evaluated step landed by then) is its final reward on the same time budget.

    python bench/async.py --bounds 0,2   # 3 seeds, 12 steps of 4 groups x 8 (18 at S=2): 23 minutes here
    python bench/async.py                # and S = 1 and 4

Four groups a step: on a 2-core CPU the trainer and the sampler share the cores, so a larger batch
makes a step's compute, not its waiting, the bound (at 8 groups a step trained for 5 s of the
synchronous step's 20 s).

Each run also gets ART's PipelineTrainer's throughput score (accepted trained tokens per second,
discounted for staleness: `throughput_score`), so that the bounds compare on one number too.

Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402
from client.model import TrainableModel  # noqa: E402
from client.loop.evaluation import evaluate  # noqa: E402
from client.loop.training_loop import train_loop  # noqa: E402
from client.loop.config import LoopConfig  # noqa: E402
from examples.demo.task import ShopEnv, ShopExample  # noqa: E402
from protocol.config import TrainConfig  # noqa: E402

TOOL_SECONDS = (0.2, 2.0)
SCORE_SECONDS, TAIL_SECONDS, TAIL_SHARE = (0.2, 0.5), (4.0, 8.0), 1 / 8
HELD_OUT = 64
FRESHNESS_TAU_STEPS = 8.0  # ART's PipelineTrainer's (_SCORE_FRESHNESS_TAU_STEPS)


class SlowShopEnv(ShopEnv):
    def __init__(self, task, rng: random.Random):
        super().__init__(task)
        self.rng = rng

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        await asyncio.sleep(math.exp(self.rng.uniform(*map(math.log, TOOL_SECONDS))))
        return await super().call_tool(name, arguments)

    async def score(self, messages):
        tail = self.rng.random() < TAIL_SHARE
        await asyncio.sleep(self.rng.uniform(*(TAIL_SECONDS if tail else SCORE_SECONDS)))
        return await super().score(messages)


class SlowShopExample(ShopExample):
    def __init__(self, seed: int):
        super().__init__()
        self.rng = random.Random(seed)

    def make_env(self, task):
        return SlowShopEnv(task, random.Random(self.rng.random()))


async def train_one(url: str, bound: int, seed: int, args: dict[str, Any], out: Path) -> dict[str, Any]:
    name = f"async-s{bound}-seed{seed}"
    steps = args["steps"] if bound == 0 else math.ceil(args["steps"] * args["async_steps_factor"])
    cfg = LoopConfig(server=url, run=name, steps=steps, groups_per_step=args["groups"],
                     group_size=args["group_size"], eval_every=0, eval_tasks=8, seed=seed, out=out / name,
                     progress=False, max_steps_off_policy=bound, train=TrainConfig(learning_rate=args["lr"]))
    summary = await train_loop(cfg, example=SlowShopExample(seed))
    start = summary["evals"][0]["wall_seconds"]  # after the opening evaluation: the same for every run
    landed = {h["step"]: h["wall_seconds"] - start for h in summary["history"] if h.get("trained")}
    trained = [h for h in summary["history"] if h.get("trained")]
    staleness = [h["staleness_mean"] for h in trained if h.get("staleness_mean") is not None]
    train_seconds = max(landed.values()) if landed else None
    return {"S": bound, "seed": seed, "run": name, "landed": landed, "train_seconds": train_seconds,
            "throughput": throughput_score([(h["trainable_tokens"], h.get("staleness_mean") or 0.0) for h in trained],
                                           train_seconds or 0.0),
            "staleness_mean": statistics.fmean(staleness) if staleness else None,
            "staleness_max": max((h.get("staleness_max") or 0 for h in trained), default=None),
            "groups_dropped_stale": sum(h.get("groups_dropped_stale", 0) for h in summary["history"])}


def throughput_score(steps: list[tuple[int, float]], seconds: float, tau: float = FRESHNESS_TAU_STEPS) -> dict[str, Any]:
    """ART's PipelineTrainer's objective score for a run: the trained tokens accepted per second,
    times a freshness discount, 1 / E[exp(age / tau)] over those tokens, age being how many steps
    older than the trained policy the sampling one was. `steps`: each trained step's (trainable
    tokens, mean staleness); art-server reports a step's mean and max staleness, not each token's,
    so a step's tokens all count at its mean."""
    tokens = sum(n for n, _ in steps)
    if not tokens or seconds <= 0:
        return {"accepted_tokens_per_second": None, "freshness": None, "score": None}
    per_second = tokens / seconds
    freshness = tokens / sum(n * math.exp(max(age, 0.0) / tau) for n, age in steps)
    return {"accepted_tokens_per_second": round(per_second, 2), "freshness": round(freshness, 4),
            "score": round(per_second * freshness, 2)}


class HeldOut:
    """Each run's held-out reward by step, a step evaluated only when first asked for. Time to reward
    scans a run's evaluated steps in order and stops at the first that reaches the target: the same
    answer as evaluating every step first, for a fraction of the evaluations (there are 66 steps a
    seed). `evaluate_step(run, step)`: the reward, evaluated."""

    def __init__(self, evaluate_step: Callable[[dict[str, Any], int], Awaitable[float]], every: int):
        self.evaluate_step, self.every = evaluate_step, every

    def steps(self, run: dict[str, Any]) -> list[int]:
        """The steps that may be evaluated: every `every`-th and the last."""
        return sorted({s for s in run["landed"] if s % self.every == 0} | {max(run["landed"])})

    async def reward(self, run: dict[str, Any], step: int) -> float:
        if step not in run.setdefault("held_out", {}):
            run["held_out"][step] = await self.evaluate_step(run, step)
        return run["held_out"][step]

    async def final(self, run: dict[str, Any]) -> float:
        return await self.reward(run, max(run["landed"]))

    async def seconds_to(self, run: dict[str, Any], target: float) -> float | None:
        """When the first evaluated step whose reward reaches `target` landed."""
        for step in self.steps(run):
            if await self.reward(run, step) >= target:
                return run["landed"][step]
        return None

    async def reward_by(self, run: dict[str, Any], seconds: float) -> float | None:
        """The held-out reward of the newest evaluated step that had landed `seconds` into the run."""
        landed = [s for s in self.steps(run) if run["landed"][s] <= seconds + 1e-6]
        return await self.reward(run, max(landed)) if landed else None


def on_server(url: str) -> Callable[[dict[str, Any], int], Awaitable[float]]:
    """HeldOut's evaluation: a run's step on the server, on the demo's first 64 held-out tasks, sampled
    with the run's seed (the steps of one seed's runs are compared on the same draws)."""
    example, models = ShopExample(), {}
    tasks = example.eval_tasks()[:HELD_OUT]

    async def evaluate_step(run: dict[str, Any], step: int) -> float:
        if run["run"] not in models:
            models[run["run"]] = await TrainableModel(run["run"]).register(url)
        return await evaluate(models[run["run"]], example, tasks, progress=False, step=step, seed=run["seed"])

    return evaluate_step


async def time_to_reward(held_out: HeldOut, runs: list[dict[str, Any]], seeds: int) -> None:
    """Each run's final reward, its time to its seed's synchronous final reward (less one standard
    error) and the ratio of that to the synchronous run's own, and its reward on the synchronous
    run's time budget."""
    for run in runs:
        run["final_reward"] = await held_out.final(run)
    for seed in range(seeds):
        sync = next(r for r in runs if r["seed"] == seed and r["S"] == 0)
        p = sync["final_reward"]
        target = p - math.sqrt(max(p * (1 - p), 1e-9) / HELD_OUT)
        base = await held_out.seconds_to(sync, target)
        for run in (r for r in runs if r["seed"] == seed):
            run["target_reward"] = target
            run["reward_at_sync_seconds"] = await held_out.reward_by(run, sync["train_seconds"])
            run["seconds_to_target"] = await held_out.seconds_to(run, target)
            run["ratio_to_sync"] = (run["seconds_to_target"] / base
                                    if run["seconds_to_target"] is not None and base else None)


def main(seeds: int = 3, steps: int = 12, groups: int = 4, group_size: int = 8, lr: float = 2e-3,
         bounds: str = "0,1,2,4", eval_every: int = 1, async_steps_factor: float = 1.5) -> None:
    args = {"steps": steps, "groups": groups, "group_size": group_size, "lr": lr,
            "async_steps_factor": async_steps_factor}
    bound_list = [int(b) for b in bounds.split(",")]
    if bound_list[0] != 0:
        raise typer.BadParameter("--bounds must start with 0: the synchronous run is the baseline")
    started = time.time()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, LocalServer(Path(tmp) / "data") as server:
        for seed in range(seeds):
            for bound in bound_list:
                run = asyncio.run(train_one(server.url, bound, seed, args, Path(tmp) / "out"))
                print(f"seed {seed} S={bound}: {len(run['landed'])} steps in {run['train_seconds']:.0f}s, staleness mean "
                      f"{run['staleness_mean']}, dropped {run['groups_dropped_stale']}", flush=True)
                runs.append(run)
        asyncio.run(time_to_reward(HeldOut(on_server(server.url), eval_every), runs, seeds))
    by_bound = {}
    for bound in bound_list:
        mine = [r for r in runs if r["S"] == bound]
        ratios = [r["ratio_to_sync"] for r in mine if r["ratio_to_sync"] is not None]
        by_bound[str(bound)] = {
            "ratio_to_sync_median": statistics.median(ratios) if ratios else None,
            "ratios": [r["ratio_to_sync"] for r in mine],
            "reached_target": f"{len(ratios)}/{len(mine)}",
            "final_reward_mean": statistics.fmean(r["final_reward"] for r in mine),
            "final_rewards": [r["final_reward"] for r in mine],
            "rewards_at_sync_seconds": [r["reward_at_sync_seconds"] for r in mine],
            "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in mine),
            "staleness_mean": statistics.fmean([r["staleness_mean"] for r in mine if r["staleness_mean"] is not None]
                                               or [0.0]),
            "groups_dropped_stale": sum(r["groups_dropped_stale"] for r in mine),
            "throughput_score_median": statistics.median(scores) if (scores := [
                r["throughput"]["score"] for r in mine if r["throughput"]["score"] is not None]) else None}
    for run in runs:
        run["landed"] = {str(k): round(v, 2) for k, v in run["landed"].items()}
        run["held_out"] = {str(k): v for k, v in run["held_out"].items()}
    print(json.dumps({
        "bench": "async", "workload": {"task": "demo (embedded model)", "tool_seconds": TOOL_SECONDS,
                                       "score_seconds": SCORE_SECONDS, "tail_score_seconds": TAIL_SECONDS,
                                       "tail_share": TAIL_SHARE},
        "settings": {**args, "seeds": seeds, "held_out_tasks": HELD_OUT, "eval_every": eval_every},
        "by_bound": by_bound, "runs": runs, "seconds_total": time.time() - started}))


if __name__ == "__main__":
    typer.run(main)
