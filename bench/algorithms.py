"""A*-PO vs GRPO vs REINFORCE with a baseline, each with a curriculum and without, on the same
sample budget: SmolLM2-135M-Instruct on the learning benchmark's reasoning-gym task through
art-server (examples/reasoning_gym: leg_counting, two solved examples as earlier turns).

Every run is `client.train`'s loop (`train_loop`) with one option set changed, on one art-server
(a run each, its own LoRA, one after the other):

- grpo:      loss ppo (PPO-clipped), baseline group_mean, groups of G
- reinforce: loss importance_sampling (REINFORCE; on-policy the truncated weight is 1), baseline
             leave_one_out (RLOO), groups of G
- apo:       A*-PO (Brantley et al. 2025): V*(x) from N base-model samples per prompt (beta_1 0.5),
             then one sample per prompt regressed with beta_2 * log pi/pi_ref on r - V*(x)

The budget is the number of sampled completions a run trains from, V*'s reference samples
included: steps * prompts_per_step * G for grpo and reinforce. A*-PO spends half of it on its
stage 1 (a pool of budget / (2 N) prompts, N samples each, estimated as each is first drawn) and
half on stage 2 (prompts_per_step * G / 2 single samples per step, drawn from that pool). What each
run actually spent is reported (`samples`); a curriculum's new level brings A*-PO new prompts to
estimate, which can take it past the budget, and the level checks' held-out rollouts are counted
apart (`curriculum_check_samples`).

The curriculum: every `--curriculum-every` steps, held-out success of the current level (sampled
at the task's temperature) is measured on `--curriculum-eval-tasks` questions; past
`--curriculum-threshold` the level goes up (examples/reasoning_gym.LEVELS: more kinds of animals
and more of each).

Held-out accuracy is greedy (temperature 0) on a fixed set with questions of every level in equal
numbers, measured after the runs on the checkpoints of steps 0, every `--eval-every` and the last.

    python bench/algorithms.py            # 16 steps of 4 prompts x 8 per run; one JSON line last, a PNG beside it
    python bench/algorithms.py --quick    # 2 steps of 2 prompts x 8: that it runs end to end, and a first figure
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402
from examples import reasoning_gym as learn_task  # noqa: E402

ALGORITHMS = ("grpo", "reinforce", "apo")
LEARNING_RATE = 2e-4  # bench/learn.py's, chosen there for 4 prompts x 8 on this task


# Micro-batches of 1024 tokens, not 4096: a training server beside others on a 24 GiB machine was
# OOM-killed at 9 GiB; the cut does not change the gradient (losses.aggregate).
MICROBATCH_TOKENS = 1024


def train_config(algorithm: str, lr: float, apo_beta: float):
    from protocol.config import TrainConfig

    common = {"learning_rate": lr, "max_tokens_per_microbatch": MICROBATCH_TOKENS}
    if algorithm == "grpo":
        return TrainConfig(**common, loss="ppo", baseline="group_mean")
    if algorithm == "reinforce":
        return TrainConfig(**common, loss="importance_sampling", baseline="leave_one_out")
    if algorithm == "apo":
        return TrainConfig(**common, loss="apo", apo_beta=apo_beta)
    raise ValueError(f"unknown algorithm {algorithm!r}: use {', '.join(ALGORITHMS)}")


def shape(algorithm: str, a: argparse.Namespace) -> dict[str, int]:
    """Prompts per step, samples per prompt and train pool of a run, for the same sample budget."""
    budget = a.steps * a.prompts_per_step * a.group_size
    if algorithm != "apo":
        return {"prompts_per_step": a.prompts_per_step, "group_size": a.group_size, "pool": a.pool,
                "value_samples": 0, "budget": budget}
    per_step = max(1, a.prompts_per_step * a.group_size // 2)
    return {"prompts_per_step": per_step, "group_size": 1, "pool": max(1, budget // (2 * a.value_samples)),
            "value_samples": a.value_samples, "budget": budget}


def eval_rows(task: str, n: int, levels: int) -> list[tuple[int, dict[str, Any]]]:
    """n held-out questions, as many of each level (other seeds than training's)."""
    per = max(1, n // levels)
    return [(lvl, r) for lvl in range(levels) for r in learn_task.rows(task, per, learn_task.EVAL_SEED, lvl)]


async def greedy_accuracy(client, model: str, rows, prompt: str, max_tokens: int) -> dict[str, Any]:
    scores = await learn_task.greedy_scores(client, model, [r for _, r in rows], prompt, max_tokens, concurrency=16)
    per_level: dict[int, list[float]] = {}
    for (lvl, _), s in zip(rows, scores):
        per_level.setdefault(lvl, []).append(s)
    return {"accuracy": sum(scores) / len(scores),
            "per_level": {str(k): round(sum(v) / len(v), 4) for k, v in sorted(per_level.items())}}


def spent(history: list[dict[str, Any]], curriculum) -> dict[str, int]:
    policy = sum((h.get("trajectories_total") or 0) + (h.get("trajectories_excluded") or 0) for h in history)
    reference = max((h.get("value_samples") or 0 for h in history), default=0)
    checks = sum(1 for h in history if h.get("trained") and curriculum is not None and curriculum.due(h["step"]))
    return {"policy": policy, "reference": reference, "total": policy + reference,
            "curriculum_check_samples": checks * (curriculum.eval_tasks if curriculum else 0)}


async def one_run(url: str, algorithm: str, with_curriculum: bool, a: argparse.Namespace, rows,
                  work: Path) -> dict[str, Any]:
    from client import TrainableModel
    from client.loop.curriculum import Curriculum
    from client.loop.training_loop import train_loop
    from client.loop.config import LoopConfig

    s = shape(algorithm, a)
    name = f"{algorithm}-{'curriculum' if with_curriculum else 'flat'}"
    example = learn_task.make_example(a.task, a.prompt, n_train=s["pool"])
    example.settings.temperature, example.settings.max_tokens = a.temperature, a.max_tokens
    curriculum = Curriculum(threshold=a.curriculum_threshold, every=a.curriculum_every,
                            eval_tasks=a.curriculum_eval_tasks) if with_curriculum else None
    cfg = LoopConfig(server=url, run=name, example=example.name, steps=a.steps,
                     groups_per_step=s["prompts_per_step"], group_size=s["group_size"], eval_every=0, eval_tasks=1,
                     seed=a.seed, out=work / name, progress=False, patience=a.steps,
                     train=train_config(algorithm, a.lr, a.apo_beta), curriculum=curriculum,
                     value_samples=max(1, s["value_samples"]), value_beta=a.value_beta)
    started = time.perf_counter()
    error = None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the loop's step lines: stdout is for the JSON line
            summary = await train_loop(cfg, example)
    except Exception as exc:  # a run that cannot learn (e.g. A*-PO with no solved prompt) is a result too
        error = f"{type(exc).__name__}: {exc}"
        summary = json.loads((work / name / "summary.json").read_text()) if (work / name / "summary.json").exists() \
            else {"history": []}
    seconds = time.perf_counter() - started
    history = summary.get("history", [])
    trained_steps = [h["step"] for h in history if h.get("trained")]
    last = max(trained_steps, default=0)
    points = sorted({0, last, *[k for k in trained_steps if k % a.eval_every == 0]})
    model = await TrainableModel(name).register(url)
    curve = []
    samples_by_step = {0: 0}
    running = 0
    for h in history:
        running += (h.get("trajectories_total") or 0) + (h.get("trajectories_excluded") or 0)
        samples_by_step[h["step"]] = running + (h.get("value_samples") or 0)
    async with model.openai_client(max_retries=0) as client:
        for k in points:
            acc = await greedy_accuracy(client, f"{name}@{k}", rows, a.prompt, a.max_tokens)
            curve.append([samples_by_step.get(k, running), k, round(acc["accuracy"], 4), acc["per_level"]])
            print(f"{name} step {k}: held-out {acc['accuracy']:.3f} {acc['per_level']}", file=sys.stderr, flush=True)
    return {"algorithm": algorithm, "curriculum": with_curriculum, "shape": s, "samples": spent(history, curriculum),
            "curve": curve, "final_accuracy": curve[-1][2], "steps_trained": len(trained_steps),
            "levels": [h.get("curriculum_level") for h in history] if with_curriculum else None,
            "level_success": [h.get("level_success") for h in history] if with_curriculum else None,
            "advantage_positive_fraction": [h.get("advantage_positive_fraction") for h in history],
            "value_prompts_unsolved": history[-1].get("value_prompts_unsolved") if history else None,
            "train_seconds": round(seconds, 1), "error": error}


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({run["curriculum"] for run in result["runs"]})  # a panel for each mode measured
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, with_curriculum in zip(axes, modes):
        for run in result["runs"]:
            if run["curriculum"] == with_curriculum:
                xs = [p[0] for p in run["curve"]]
                ys = [p[2] for p in run["curve"]]
                ax.plot(xs, ys, marker="o", label=run["algorithm"])
        ax.set_title("with curriculum" if with_curriculum else "no curriculum", fontsize=9)
        ax.set_xlabel("sampled completions spent (V* reference samples included)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("held-out accuracy (greedy, all levels)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default=learn_task.TASK, choices=sorted(learn_task.LEVELS))
    ap.add_argument("--prompt", default=learn_task.PROMPT, choices=sorted(learn_task.PROMPTS))
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated, of " + ", ".join(ALGORITHMS))
    ap.add_argument("--curriculum", choices=["both", "on", "off"], default="both")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--pool", type=int, default=1024, help="training questions per level for grpo and reinforce")
    ap.add_argument("--value-samples", type=int, default=8, help="A*-PO's reference samples per prompt (N)")
    ap.add_argument("--value-beta", type=float, default=0.5, help="A*-PO's beta_1")
    ap.add_argument("--apo-beta", type=float, default=1e-3, help="A*-PO's beta_2")
    ap.add_argument("--curriculum-threshold", type=float, default=0.5)
    ap.add_argument("--curriculum-every", type=int, default=4)
    ap.add_argument("--curriculum-eval-tasks", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out questions, split evenly over the levels")
    ap.add_argument("--lr", type=float, default=LEARNING_RATE)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="2 steps of 2 prompts x 8, A*-PO N=4, a level check every step at 0.25, 24 held-out")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench-algorithms")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.prompts_per_step, a.group_size, a.value_samples = 2, 2, 8, 4
        a.curriculum_every, a.curriculum_threshold, a.curriculum_eval_tasks = 1, 0.25, 8
        a.eval_every, a.eval_n = 2, 24
    a.algorithms = [x.strip() for x in a.algorithms.split(",") if x.strip()]
    bad = [x for x in a.algorithms if x not in ALGORITHMS]
    if bad or not a.algorithms:
        ap.error(f"--algorithms: {', '.join(bad) or 'none given'}; use {', '.join(ALGORITHMS)}")
    for flag in ("steps", "prompts_per_step", "group_size", "value_samples", "curriculum_every", "eval_every",
                 "eval_n", "curriculum_eval_tasks", "pool"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if a.group_size < 2:
        ap.error("--group-size must be >= 2: grpo and reinforce compare samples within a group")
    if not 0 < a.curriculum_threshold <= 1:
        ap.error("--curriculum-threshold is a success rate in (0, 1]")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from tests.real_models import CACHE, smollm2_gguf

    gguf = smollm2_gguf()
    levels = len(learn_task.LEVELS[a.task])
    rows = eval_rows(a.task, a.eval_n, levels)
    a.out.mkdir(parents=True, exist_ok=True)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[a.curriculum]
    settings = {k: getattr(a, k) for k in ("task", "prompt", "steps", "prompts_per_step", "group_size",
                                            "value_samples", "value_beta", "apo_beta", "curriculum_threshold",
                                            "curriculum_every", "curriculum_eval_tasks", "eval_every", "lr",
                                            "temperature", "max_tokens", "seed", "quick")}
    settings.update(model=gguf.name, eval="greedy", eval_questions=len(rows), levels=levels,
                    budget=a.steps * a.prompts_per_step * a.group_size)
    result: dict[str, Any] = {"settings": settings, "runs": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as scratch, \
            LocalServer(Path(scratch) / "data", model=gguf, extra=["--device", "cpu", "--cache-dir", str(CACHE)]) as server:
        for with_curriculum in modes:
            for algorithm in a.algorithms:
                result["runs"].append(asyncio.run(one_run(server.url, algorithm, with_curriculum, a, rows, Path(scratch))))
                # What is measured so far, should the bench be stopped before the end.
                (a.out / "algorithms.partial.json").write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["final_accuracy"] = {f"{r['algorithm']}{'+curriculum' if r['curriculum'] else ''}": r["final_accuracy"]
                                for r in result["runs"]}
    png = a.out / "algorithms.png"
    plot(result, png, f"SmolLM2-135M on {a.task}: A*-PO / GRPO / REINFORCE (RLOO), {settings['budget']} samples each "
                      f"({a.steps} steps), lr {a.lr:.3g}")
    result["plot"] = str(png)
    (a.out / "algorithms.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
