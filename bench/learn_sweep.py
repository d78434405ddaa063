"""A learning sweep: bench/learn.py's single run (art-server GRPO vs TRL's GRPOTrainer, same settings)
over reasoning-gym tasks of several families x seeds, to say whether artisan learns as TRL does
beyond one task and one seed.

A seed draws other training questions (rows seed TRAIN_SEED + seed), another LoRA init and TRL's
sampling seed; the held-out questions stay the same, so every seed's step 0 is the same greedy
model on the same prompts, and the spread over seeds is the spread of what training did.

Every (task, seed, trainer) run appends one JSON line to the results file as soon as it ends; a
rerun with the same model and settings skips the runs already there, so a sweep of hours can be
done in parts (`--tasks`, `--trainers`, `--seeds` pick a part). The default results file,
bench/results/learn-sweep.jsonl, is committed, because a sweep outlives the machine it starts on;
each line names the commit it ran on. At the end it reads every matching
line back and prints one JSON line: per task and trainer, base and final held-out accuracy (mean
and standard error over seeds), the rise, per-seed figures and the verdicts below, and per trainer a
tally over the tasks; a PNG of the curves is written beside the results.

A run keeps its first and last evaluations whole (each question's greedy reply and score), so that a
rise is told from a collapse: `beyond_shuffled` is the accuracy less what the same replies score
given to the other questions, which answering one thing to all, or a reply the scorer pays in part
whatever the question, cannot raise. Runs from before the replies were kept have no such figure.

    python bench/learn.py --sweep                                  # 9 tasks x seeds 0 1 2 x both (hours)
    python bench/learn.py --sweep --quick --tasks leg_counting --seeds 0      # a smoke run
    python bench/learn.py --sweep --model gemma3 --tasks leg_counting count_primes
    python bench/learn.py --sweep --trainers artisan --tasks basic_arithmetic --dynamic-sampling 8
        # a variant of artisan's recipe, summed up beside TRL's runs without it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learn  # noqa: E402
from client.local_server import ROOT  # noqa: E402
from examples import reasoning_gym as learn_task  # noqa: E402
from greedy_scores import beyond_shuffled  # noqa: E402

# Nine tasks of five families, every one with SmolLM2's greedy few-shot base accuracy strictly between
# 0 and 1 (examples/reasoning_gym, bench/learn_base_rates.py): room to learn and groups that disagree.
FAMILIES: dict[str, str] = {
    "basic_arithmetic": "arithmetic", "chain_sum": "arithmetic", "products": "arithmetic",
    "leg_counting": "counting", "letter_counting": "counting",
    "spell_backward": "string", "word_sequence_reversal": "string",
    "syllogism": "logic", "count_primes": "algorithmic",
}
# Answers longer than learn.py's 8 tokens ("go, hundred, to" is 6-9): 8 would cut right answers.
MAX_TOKENS: dict[str, int] = {"word_sequence_reversal": 16}
TRAINERS = ("artisan", "trl")
RISE_THRESHOLD = 0.10
NOISE_Z = 2.0  # "within noise": within two standard errors of the difference
RESULTS = ROOT / "bench" / "results" / "learn-sweep.jsonl"  # committed (see the module's docstring)


class Served(NamedTuple):
    gguf: Path
    chat_template: Path | None = None  # None: the model's own
    stop_tokens: tuple[str, ...] = ()  # art-server's --stop-token, and TRL's generation config's EOS


def _models() -> dict[str, Callable[[], Served]]:
    """How each model is served to both trainers."""
    from tests.real_models import gemma3_gguf, smollm2_gguf

    return {"smollm2": lambda: Served(smollm2_gguf()),
            # a base model: plain-text shots it can continue (examples/reasoning_gym's BASE_MODEL_TEMPLATE)
            "gemma3": lambda: Served(gemma3_gguf(), learn_task.BASE_MODEL_TEMPLATE, learn_task.BASE_MODEL_STOP)}


# ---- aggregation (pure) -------------------------------------------------------------------------

def mean_se(values: Iterable[float]) -> dict[str, Any]:
    """Mean and standard error of the mean (sample std / sqrt n); the error is None under two values."""
    xs = list(values)
    if not xs:
        return {"mean": None, "se": None, "n": 0}
    mean = sum(xs) / len(xs)
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
    return {"mean": round(mean, 4), "se": None if se is None else round(se, 4), "n": len(xs)}


def rise(base: float, final: float) -> float:
    return round(final - base, 4)


def ends_below_base(rise_mean: float) -> bool:
    return rise_mean < 0


def rises_by(rise_mean: float, threshold: float = RISE_THRESHOLD) -> bool:
    return rise_mean >= threshold - 1e-9  # the rises are rounded to 4 places


def at_least_within_noise(a: dict[str, Any], b: dict[str, Any], z: float = NOISE_Z) -> bool | None:
    """Whether `a`'s mean is at least `b`'s less z standard errors of their difference; None where
    either has no standard error (one seed: the noise is not measured)."""
    if a["se"] is None or b["se"] is None:
        return None
    return a["mean"] >= b["mean"] - z * math.hypot(a["se"], b["se"]) - 1e-9


def constant_answer(answers: Iterable[Any]) -> dict[str, Any]:
    """The held-out accuracy of answering every question with the most common answer. A run can
    "rise" to it by collapsing onto that answer: syllogism (Yes/No) went 0.297 -> 0.703 in 4 steps,
    and 45 of its 64 held-out answers are "Yes"."""
    counts = Counter(str(a) for a in answers)
    if not counts:
        return {"answer": None, "share": None}
    answer, n = counts.most_common(1)[0]
    return {"answer": answer, "share": round(n / counts.total(), 4)}


def no_better_than_constant(final_mean: float | None, share: float | None) -> bool | None:
    """Whether the final accuracy is at most the constant answer's: then its rise is not evidence
    of learning (the model may answer one thing to everything)."""
    if final_mean is None or share is None:
        return None
    return final_mean <= share + 1e-9


def top_reply(replies: Iterable[str]) -> dict[str, Any]:
    """The final evaluation's most common reply and its share: near 1, the run answers one thing to all."""
    top = constant_answer(replies)
    return {"reply": top["answer"], "share": top["share"]}


def trainer_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One trainer's runs of one task (one entry per seed) summed up over seeds."""
    seeds = {str(e["seed"]): {"base": e["base"], "final": e["final"], "rise": rise(e["base"], e["final"]),
                              "rise_beyond_shuffled": (e.get("beyond_shuffled") or {}).get("rise"),
                              "top_reply": e.get("top_reply"), "seconds_per_step": e.get("seconds_per_step")}
             for e in sorted(entries, key=lambda e: e["seed"])}
    rises, final = mean_se(s["rise"] for s in seeds.values()), mean_se(s["final"] for s in seeds.values())
    # from any run that recorded it: the held-out questions are the same for every seed
    share = next((e["constant_answer"]["share"] for e in entries if e.get("constant_answer")), None)
    beyond = [s["rise_beyond_shuffled"] for s in seeds.values()]
    beyond_mean = mean_se(beyond) if None not in beyond else mean_se([])  # every seed's, or none: runs kept no replies
    return {"base": mean_se(s["base"] for s in seeds.values()), "final": final,
            "rise": rises, "ends_below_base": ends_below_base(rises["mean"]),
            f"rises_by_{RISE_THRESHOLD:.2f}": rises_by(rises["mean"]),
            "no_better_than_constant_answer": no_better_than_constant(final["mean"], share),
            "rise_beyond_shuffled": beyond_mean,
            f"rises_by_{RISE_THRESHOLD:.2f}_beyond_shuffled":
                None if beyond_mean["mean"] is None else rises_by(beyond_mean["mean"]),
            "seeds": seeds}


def tally(tasks: dict[str, Any], trainer: str = "artisan") -> dict[str, Any]:
    """The sweep's verdict over tasks for one trainer: which end below their base, which rise by the
    threshold, and which rise by it beyond what their replies score given to other questions (not
    known for runs that kept no replies)."""
    ran = {t: s[trainer] for t, s in tasks.items() if trainer in s}
    rises, beyond = f"rises_by_{RISE_THRESHOLD:.2f}", f"rises_by_{RISE_THRESHOLD:.2f}_beyond_shuffled"
    return {"tasks": len(ran),
            "ends_below_base": [t for t, s in ran.items() if s["ends_below_base"]],
            rises: [t for t, s in ran.items() if s[rises]],
            beyond: [t for t, s in ran.items() if s[beyond]],
            "beyond_shuffled_unknown": [t for t, s in ran.items() if s[beyond] is None]}


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task and trainer; where both trainers ran, whether artisan's rise is at least TRL's within noise."""
    tasks: dict[str, Any] = {}
    for task in dict.fromkeys(e["task"] for e in entries):
        constant = next((e["constant_answer"] for e in entries if e["task"] == task and e.get("constant_answer")), None)
        out: dict[str, Any] = {"family": FAMILIES.get(task), "constant_answer": constant}
        for trainer in TRAINERS:
            runs = [e for e in entries if e["task"] == task and e["trainer"] == trainer]
            if runs:
                out[trainer] = trainer_summary(runs)
        if all(t in out for t in TRAINERS):
            out["artisan_at_least_trl_within_noise"] = at_least_within_noise(out["artisan"]["rise"], out["trl"]["rise"])
        tasks[task] = out
    return tasks


def time_ratios(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """For every task and seed both trainers ran: artisan's training seconds to first reach the
    held-out accuracy TRL ended with, over TRL's own (bench/learn.py's compare), and the median of
    those. A pair where TRL ended no better than it started has no time to compare (None, left out
    of the median); one where artisan never reached TRL's final counts as infinitely slow."""
    runs = {(e["task"], e["seed"], e["trainer"]): e for e in entries}
    pairs: dict[str, float | str | None] = {}
    ratios: list[float] = []
    for (task, seed, trainer), e in sorted(runs.items()):
        trl = runs.get((task, seed, "trl"))
        if trainer != "artisan" or trl is None:
            continue
        compared = learn.compare(e["curve"], trl["curve"])
        ratio = compared["time_ratio_to_trl_final"]
        pairs[f"{task}/{seed}"] = None if not compared["trl_learned"] else "never" if ratio is None else ratio
        if compared["trl_learned"]:
            ratios.append(math.inf if ratio is None else ratio)
    median = round(statistics.median(ratios), 3) if ratios else None
    return {"pairs": pairs, "median": "never" if median == math.inf else median}


def mean_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """[step, mean accuracy, standard error (0 for one curve)] at each step every curve has."""
    steps = sorted(set.intersection(*({int(p[1]) for p in c} for c in curves))) if curves else []
    out = []
    for step in steps:
        m = mean_se(p[2] for c in curves for p in c if int(p[1]) == step)
        out.append([step, m["mean"], m["se"] or 0.0])
    return out


def run_key(model: str, config: dict[str, Any], task: str, seed: int, trainer: str) -> str:
    return json.dumps([model, config, task, seed, trainer], sort_keys=True)


def pending(done: set[str], model: str, configs: dict[tuple[str, str], dict[str, Any]],
            seeds: list[int]) -> list[tuple[str, int, str]]:
    """The (task, seed, trainer) runs the results file does not hold yet, in sweep order; `configs`
    is each (task, trainer)'s settings."""
    tasks, trainers = dict.fromkeys(t for t, _ in configs), dict.fromkeys(tr for _, tr in configs)
    return [(t, s, tr) for t in tasks for s in seeds for tr in trainers
            if run_key(model, configs[t, tr], t, s, tr) not in done]


# ---- running ------------------------------------------------------------------------------------

def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _config(a: argparse.Namespace, task: str, trainer: str = "artisan") -> dict[str, Any]:
    """The settings a run's figures depend on: a rerun with other settings is another run. Dynamic
    sampling is artisan's alone, so TRL's runs beside it are those without it."""
    config = {"prompt": a.prompt, "steps": a.steps, "eval_every": a.eval_every, "eval_n": a.eval_n,
              "group_size": a.group_size, "prompts_per_step": a.prompts_per_step, "lr": a.lr,
              "temperature": a.temperature, "max_tokens": MAX_TOKENS.get(task, a.max_tokens)}
    if a.reward != learn_task.REWARD:
        config["reward"] = a.reward  # absent when the default, as below
    if trainer == "artisan" and a.dynamic_sampling:
        config["dynamic_sampling"] = a.dynamic_sampling  # absent when off: the runs from before it keep their key
    return config


def _commit() -> str | None:
    """The checkout a run measured, "+dirty" where its files (the results aside) differed from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_one(a: argparse.Namespace, served: Served, task: str, seed: int, trainer: str) -> dict[str, Any]:
    from tests.real_models import CACHE, converted

    config, commit = _config(a, task, trainer), _commit()  # the checkout the run starts from (its server loads it)
    # the options a run's key leaves out where they are the default are still the run's settings
    run = argparse.Namespace(**{"reward": a.reward, "dynamic_sampling": 0, **config}, task=task, seed=seed,
                             chat_template=served.chat_template, stop_tokens=served.stop_tokens)
    train_rows = learn_task.rows(task, learn.train_size(a), learn_task.TRAIN_SEED + seed)
    eval_rows = learn_task.rows(task, a.eval_n, learn_task.EVAL_SEED)
    with tempfile.TemporaryDirectory(prefix="bench-learn-sweep-") as scratch:
        if trainer == "artisan":
            out = learn.run_artisan(run, served.gguf, CACHE, train_rows, eval_rows, Path(scratch))
        else:
            out = learn.run_trl(run, converted(served.gguf), train_rows, eval_rows, Path(scratch))
    curve, held = out["curve"], out["held_out"]
    base_beyond, final_beyond = beyond_shuffled(held["base"]), beyond_shuffled(held["final"])
    return {"model": a.model, "config": config, "task": task, "seed": seed, "trainer": trainer, "commit": commit,
            "base": curve[0][2], "final": curve[-1][2], "seconds_per_step": round(curve[-1][0] / a.steps, 2),
            "constant_answer": constant_answer(r["answer"] for r in eval_rows),
            "top_reply": top_reply(held["final"]["replies"]),
            "beyond_shuffled": {"base": base_beyond, "final": final_beyond, "rise": rise(base_beyond, final_beyond)},
            "held_out": held, "curve": curve, "setup_seconds": out["setup_seconds"], "steps": out["steps"],
            "time_split": out.get("time_split")}


def plot(entries: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(e["task"] for e in entries))
    cols = min(4, max(len(tasks), 1))
    rows = max(math.ceil(len(tasks) / cols), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(max(3.6 * cols, 6.0), 2.9 * rows + 0.4), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for trainer, colour in zip(TRAINERS, ("C0", "C1")):
            curves = [e["curve"] for e in entries if e["task"] == task and e["trainer"] == trainer]
            for c in curves:
                ax.plot([p[1] for p in c], [p[2] for p in c], color=colour, alpha=0.25, lw=0.8)
            if curves:
                steps, means, ses = zip(*mean_curve(curves))
                ax.plot(steps, means, color=colour, marker="o", ms=3, label=f"{trainer} ({len(curves)} seeds)")
                ax.fill_between(steps, [m - s for m, s in zip(means, ses)], [m + s for m, s in zip(means, ses)],
                                color=colour, alpha=0.15)
        ax.set_title(f"{task} ({FAMILIES.get(task, '?')})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("held-out accuracy", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="learn.py --sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(FAMILIES), choices=sorted(learn_task.SETTINGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    learn.add_run_options(ap, max_tokens_help="all but the tasks in MAX_TOKENS")
    ap.add_argument("--quick", action="store_true", help="2 steps of 2 prompts x 4, 16 held-out questions")
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.eval_every, a.eval_n, a.group_size, a.prompts_per_step = 2, 1, 16, 4, 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    a.results.parent.mkdir(parents=True, exist_ok=True)

    served = _models()[a.model]()
    done = {run_key(e["model"], e["config"], e["task"], e["seed"], e["trainer"]) for e in read_results(a.results)}
    configs = {(t, tr): _config(a, t, tr) for t in a.tasks for tr in a.trainers}
    todo = pending(done, a.model, configs, a.seeds)
    print(f"sweep: {len(todo)} runs to do, {len(a.tasks) * len(a.seeds) * len(a.trainers) - len(todo)} already in "
          f"{a.results}", file=sys.stderr, flush=True)
    for task, seed, trainer in todo:
        print(f"sweep: {task} seed {seed} {trainer}", file=sys.stderr, flush=True)
        entry = run_one(a, served, task, seed, trainer)
        with a.results.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    wanted = {run_key(a.model, configs[t, tr], t, s, tr) for t in a.tasks for s in a.seeds for tr in a.trainers}
    entries = [e for e in read_results(a.results)
               if run_key(e["model"], e["config"], e["task"], e["seed"], e["trainer"]) in wanted]
    png = a.results.with_suffix(".png")
    dynamic = f", artisan's dynamic sampling {a.dynamic_sampling}" if a.dynamic_sampling else ""
    plot(entries, png, f"{a.model} GRPO, {a.steps} steps of {a.prompts_per_step}x{a.group_size}, lr {a.lr:.3g}, "
                       f"T {a.temperature}{dynamic}\nmean over seeds (band: 1 SE), each seed faint")
    print(json.dumps({"model": a.model, "settings": _config(a, a.tasks[0]) | {"max_tokens": a.max_tokens},
                      "max_tokens_per_task": {t: MAX_TOKENS[t] for t in a.tasks if t in MAX_TOKENS},
                      "seeds": a.seeds, "noise_z": NOISE_Z, "tasks": (tasks := summarize(entries)),
                      "tally": {t: tally(tasks, t) for t in TRAINERS},
                      "time_to_trl_final": time_ratios(entries),
                      "results": str(a.results), "plot": str(png)}))


if __name__ == "__main__":
    main()
