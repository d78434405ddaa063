"""Tool use over several turns: artisan against TRL's GRPOTrainer, from one SFT start, on SmolLM2.

examples/leg_lookup: reasoning-gym leg counting with several animals, a `legs` lookup and a
calculator, up to five turns, scored by reasoning-gym's score_answer.

1. art-server (the SmolLM2-135M-Instruct GGUF under the example's template) warm-starts a run with
   its own SFT job on the example's demonstrations: `client.train --warm-start N`, the run's step 1.
2. artisan: GRPO from that step through `client.train`, the command a user runs.
3. TRL 1.16: GRPOTrainer with its tool support, from the same adapter (exported as PEFT), on the
   same questions in the same order, the same reward and settings, for the training seconds artisan
   took (bench/tool_agent_trl.py), at most its steps (`--trl-steps` more, for equal seconds where
   TRL's steps are faster); with `--only trl`, without artisan's half, for all its steps or
   `--trl-seconds`.
4. Both are judged by one held-out measure, computed the same way for both after training: greedy
   success over held-out questions (bench/tool_agent_trl.greedy_episodes), at the SFT start and
   every K steps. A curve point is [training seconds, step, success]; `by_kinds` beside it splits
   each point's success by the kinds of animal in the question (three, or four, which no
   demonstration has).

    python bench/tool_agent.py            # one JSON line last, a PNG beside it
    python bench/tool_agent.py --quick    # 2 steps of 2 x 4, 8 held-out questions: that it runs

The server's database (every trained step's trajectories, their rewards and metrics) is kept as
<out>/artisan.sqlite, each evaluated step's greedy held-out episodes as <out>/episodes/, and TRL's
sampled training episodes as <out>/episodes/trl-train.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.errors import EXIT_CANNOT_LEARN  # noqa: E402
from client.local_server import ROOT, LocalServer  # noqa: E402
from client.loop.task_draws import TaskDraws  # noqa: E402
from examples import leg_lookup  # noqa: E402
from rollouts.env import RolloutSettings, Score  # noqa: E402

RUN = "tool-agent"


def _train(server: LocalServer, a: argparse.Namespace, out: Path, steps: int) -> dict[str, Any]:
    """`client.train` on the example to `steps` (the first call also warm-starts); its summary."""
    cmd = [sys.executable, "-m", "client.train", "--server", server.url, "--example", "leg_lookup", "--run", RUN,
           "--steps", str(steps), "--groups-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
           "--learning-rate", str(a.lr), "--temperature", str(a.temperature), "--warm-start", str(a.warm_start),
           "--warm-start-learning-rate", str(a.warm_start_lr), "--demonstration-kinds", str(a.demonstration_kinds),
           "--eval-every", "0", "--eval-tasks", "1",
           "--seed", str(a.seed), "--dynamic-sampling", str(a.dynamic_sampling), "--no-progress", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode not in (0, EXIT_CANNOT_LEARN):  # a run that stopped learning is a result, kept
        raise SystemExit(f"client.train exited {done.returncode}")
    return json.loads((out / "summary.json").read_text())


def drawn_rows(example: leg_lookup.LegLookupExample, seed: int, n: int) -> list[dict[str, Any]]:
    """The first `n` training questions `client.train --seed seed` samples groups of, in its order: TRL's
    step k then sees the questions of artisan's k-th attempt (an attempt that trained nothing draws
    its questions as TRL's step without signal does)."""
    draws = TaskDraws(example.train_tasks(seed), seed)  # LoopConfig.task_seed is --seed
    return [draws.next().data["row"] for _ in range(n)]


def keep_database(db: Path, kept: Path) -> None:
    """The run's trajectories outlive the scratch folder: a curve that falls is read from them.
    SQLite's backup, so that what is still in the write-ahead log is kept too."""
    with closing(sqlite3.connect(db)) as source, closing(sqlite3.connect(kept)) as copy:
        source.backup(copy)


def run_artisan(a: argparse.Namespace, gguf: Path, work: Path) -> dict[str, Any]:
    """The warm start and artisan's GRPO (the warm start alone with `--only trl`); each evaluated
    step's adapter exported for the evaluator."""
    from trl_agents import export_peft

    data = work / "artisan-data"
    checkpoints, run_json = data / "runs" / RUN / "checkpoints", data / "runs" / RUN / "run.json"
    with LocalServer(data, model=gguf, extra=["--device", "cpu", "--chat-template", str(leg_lookup.CHAT_TEMPLATE)],
                     log=work / "server.log") as server:
        started = time.perf_counter()
        warm = _train(server, a, work / "warm", 1)
        warm_seconds = time.perf_counter() - started
        start = export_peft(checkpoints, 1, run_json, work / "adapters" / "artisan-1")
        started_with = {"start_adapter": start, "warm_start_seconds": round(warm_seconds, 1),
                        "warm_start": warm.get("warm_start")}
        if a.only == "trl":
            return started_with | {"saved": [], "stopped": None, "updates": []}
        summary = _train(server, a, work / "grpo", 1 + a.steps)
    keep_database(data / "artisan.sqlite", a.out / "artisan.sqlite")
    # Training seconds per step: each attempt's sampling, scoring and training, as its line reports.
    seconds, elapsed = {1: 0.0}, 0.0
    for h in summary["history"]:
        elapsed += h.get("timing", {}).get("wall_seconds") or 0.0
        if h["trained"]:
            seconds[h["step"]] = elapsed
    saved = [s for s in seconds if s > 1 and ((s - 1) % a.eval_every == 0 or s == max(seconds))]
    adapters = [{"step": s - 1, "train_seconds": seconds[s],
                 "adapter": export_peft(checkpoints, s, run_json, work / "adapters" / f"artisan-{s}")} for s in saved]
    # How far each step moved the adapter, beside the warm start's own figures: the size of an update
    # at one learning rate is where two trainers' steps differ first.
    updates = [{k: h.get(k) for k in ("step", "reward_mean", "grad_norm", "lora_update_norm", "optimizer_reset")}
               for h in summary["history"] if h["trained"]]
    return started_with | {"saved": adapters, "stopped": summary.get("stopped"), "updates": updates}


def trl_budget(a: argparse.Namespace, artisan_saved: list[dict[str, Any]]) -> tuple[float | None, int]:
    """TRL's budget of training seconds and its most steps: artisan's seconds (--trl-seconds alone
    with --only trl, None without it), and --trl-steps, or artisan's --steps. With --trl-steps past
    --steps, TRL uses what artisan's seconds allow rather than stopping at artisan's step count."""
    seconds = a.trl_seconds if a.only == "trl" else (artisan_saved[-1]["train_seconds"] if artisan_saved else None)
    return seconds, a.trl_steps or a.steps


def success_by_kinds(rows: list[dict], rewards: list[float]) -> dict[str, float]:
    """Held-out success by the number of kinds of animal in the question. The demonstrations have
    two or three kinds and the held-out questions three or four, so the four-kind figure is what
    the warm start was never shown: where a rise has to come from once three kinds are solved."""
    kinds: dict[str, list[float]] = {}
    for row, reward in zip(rows, rewards, strict=True):
        kinds.setdefault(str(len(row["metadata"]["animals"])), []).append(reward)
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(kinds.items())}


def curve(model_dir: Path, start: Path, saved: list[dict[str, Any]], eval_rows: list[dict],
          settings: RolloutSettings, episodes: Path) -> dict[str, list]:
    """Held-out success at the start and at each saved step: points [training seconds, step,
    success], and beside them [step, success by kinds]. Each point's greedy episodes are kept as
    `episodes`/step-K.jsonl: where greedy and sampled success part, the episodes say how."""
    from tool_agent_trl import greedy_episodes

    episodes.mkdir(parents=True, exist_ok=True)
    points, by_kinds = [], []
    for t, step, adapter in [(0.0, 0, start), *((s["train_seconds"], s["step"], s["adapter"]) for s in saved)]:
        scored = greedy_episodes(model_dir, adapter, eval_rows, settings.max_turns, settings.max_tokens)
        rewards = [score.reward for _, score in scored]
        keep_episodes(episodes / f"step-{step}.jsonl", eval_rows, scored)
        points.append([round(t, 1), step, round(sum(rewards) / len(rewards), 4)])
        by_kinds.append([step, success_by_kinds(eval_rows, rewards)])
    return {"curve": points, "by_kinds": by_kinds}


def keep_episodes(path: Path, rows: list[dict], scored: list[tuple[list[dict], Score]]) -> None:
    """One line per held-out question: it and its answer, the episode's reward and metrics, its messages."""
    path.write_text("".join(json.dumps({"question": row["question"], "answer": row["answer"], "reward": score.reward,
                                        "metrics": score.metrics, "messages": messages}) + "\n"
                            for row, (messages, score) in zip(rows, scored, strict=True)))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("artisan", "trl"):
        if name in result:
            points = result[name]["curve"]
            ax.plot([p[0] / 60 for p in points], [p[2] for p in points], marker="o", label=name)
    ax.set_xlabel("training minutes after the SFT start")
    ax.set_ylabel("held-out success (greedy)")
    ax.set_title("SmolLM2-135M, leg_lookup: GRPO with tools from one SFT start")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="artisan's GRPO steps after the warm start")
    ap.add_argument("--eval-every", type=int, default=6)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out questions")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4, help="both trainers' GRPO learning rate")
    ap.add_argument("--warm-start", type=int, default=128, help="demonstrations in the SFT start")
    ap.add_argument("--warm-start-lr", type=float, default=2e-3)
    ap.add_argument("--demonstration-kinds", type=int, default=leg_lookup.DEMONSTRATION_TASK["max_animals"],
                    help="the most kinds of animal in a demonstration (2-4)")
    ap.add_argument("--temperature", type=float,
                    help="both trainers' sampling temperature (the example's own by default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dynamic-sampling", type=int, default=0,
                    help="artisan's: groups a step sampled in place of groups that scored alike (TRL has none)")
    ap.add_argument("--only", choices=["artisan", "trl"],
                    help="one trainer's half from the warm start (TRL alone has no budget but --trl-seconds)")
    # Equal seconds, not equal steps: where TRL's steps are the faster, artisan's step count would
    # stop it with seconds of the budget unspent.
    ap.add_argument("--trl-steps", type=int,
                    help="TRL's most steps (--steps by default); it stops sooner once its training seconds pass "
                         "its budget: artisan's training seconds, or --trl-seconds")
    ap.add_argument("--trl-seconds", type=float,
                    help="with --only trl: TRL's budget of training seconds (artisan's from an earlier run)")
    ap.add_argument("--quick", action="store_true", help="2 steps of 2 x 4, 8 held-out questions, 32 demonstrations")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench-tool-agent")
    a = ap.parse_args()
    if a.trl_seconds is not None and a.only != "trl":
        ap.error("--trl-seconds is for --only trl: with both halves TRL's budget is artisan's training seconds")
    if a.quick:
        a.steps, a.eval_every, a.eval_n, a.group_size, a.prompts_per_step, a.warm_start = 2, 1, 8, 4, 2, 32
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from tests.real_models import converted, smollm2_gguf
    from tool_agent_trl import DIFFERENCES, run_trl

    gguf = smollm2_gguf()
    model_dir = converted(gguf)  # the float32 weights art-server dequantises and serves
    example = leg_lookup.make_example()
    settings = example.settings
    a.temperature = settings.temperature if a.temperature is None else a.temperature
    eval_rows = [t.data["row"] for t in example.eval_tasks()[: a.eval_n]]
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"settings": {k: v for k, v in vars(a).items() if k not in ("out", "only")} | {
        "model": gguf.name, "max_turns": settings.max_turns, "max_tokens_per_turn": settings.max_tokens,
        "eval": "greedy"}}
    with tempfile.TemporaryDirectory(prefix="bench-tool-agent-") as scratch:
        work = Path(scratch)
        artisan = run_artisan(a, gguf, work)
        result["warm_start"] = {"seconds": artisan["warm_start_seconds"], **(artisan["warm_start"] or {})}
        if a.only != "trl":
            result["artisan"] = {**curve(model_dir, artisan["start_adapter"], artisan["saved"], eval_rows,
                                       settings, a.out / "episodes" / "artisan"),
                                 "updates": artisan["updates"],
                                 **({"stopped": artisan["stopped"]} if artisan["stopped"] else {})}
            # Said now, not only in the last line: TRL's half takes as long again, and a stopped bench keeps this.
            print(f"artisan's curve [training seconds, step, held-out success]: {result['artisan']['curve']}; "
                  f"by kinds of animal [step, success]: {result['artisan']['by_kinds']}",
                  file=sys.stderr, flush=True)
        if a.only != "artisan":
            budget, trl_steps = trl_budget(a, artisan["saved"])
            train_rows = drawn_rows(example, a.seed, trl_steps * a.prompts_per_step)
            trl_train = a.out / "episodes" / "trl-train.jsonl"
            trl_train.parent.mkdir(parents=True, exist_ok=True)
            trl_train.unlink(missing_ok=True)  # this run's episodes alone
            saved = run_trl(model_dir, artisan["start_adapter"], train_rows, steps=trl_steps,
                            prompts_per_step=a.prompts_per_step, group_size=a.group_size, learning_rate=a.lr,
                            temperature=a.temperature, max_turns=settings.max_turns,
                            max_tokens_per_turn=settings.max_tokens, seed=a.seed, out=work / "trl",
                            save_every=a.eval_every, budget_seconds=budget,
                            train_episodes=trl_train)
            result["trl"] = curve(model_dir, artisan["start_adapter"], saved, eval_rows, settings,
                                  a.out / "episodes" / "trl")
    for name in ("artisan", "trl"):
        if name in result:
            points = result[name]["curve"]
            result[name]["rise"] = round(points[-1][2] - points[0][2], 4)
    result["differences"] = DIFFERENCES
    png = a.out / "tool_agent.png"
    plot(result, png)
    result["plot"] = str(png)
    (a.out / "tool_agent.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
