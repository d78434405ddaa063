"""Two agents trained together against either one trained alone, on examples/shop_team (the
embedded model): does co-training lift both runs, and does it beat training only one?

Every variant is the README's command, `python -m client.train --example shop_team`, at `make
demo`'s settings (16 groups x 8 episodes a step, held-out evaluation of 64 tasks every 4 steps),
on one server, seeded: "both" trains the assistant's and the clerk's runs as joint jobs; the
ablations pass `--train-roles assistant` or `--train-roles clerk`, the other role sampling from its
untrained start. The baselines are the ablations, measured in the same run. Reported per variant:
held-out team reward before and after (mean and standard error over seeds), and per seed each
role's own held-out reward before and after (over the episodes it acted in: the clerk acts only
when the assistant asks).

    python bench/team.py --steps 8                 # 3 variants x seeds 0,1,2, about 30 minutes on 2 cores
    python bench/team.py --seeds 0 --steps 4

Prints one JSON line. Not run in CI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import ROOT, LocalServer  # noqa: E402
from examples.demo.run_demo import DEMO_ARGS  # noqa: E402

VARIANTS = {"both": [], "assistant_only": ["--train-roles", "assistant"], "clerk_only": ["--train-roles", "clerk"]}


def mean_se(xs: list[float]) -> dict[str, float | None]:
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else None
    return {"mean": round(m, 4), "se": None if se is None else round(se, 4)}


def train(url: str, run: str, out: Path, steps: int, seed: int, extra: list[str]) -> dict:
    args = [a for a in DEMO_ARGS]
    args[args.index("--example") + 1] = "shop_team"
    args[args.index("--steps") + 1] = str(steps)
    cmd = [sys.executable, "-m", "client.train", "--server", url, "--run", run, "--out", str(out), "--no-progress",
           "--seed", str(seed), "--patience", "5", *args, *extra]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["evals"][0], summary["evals"][-1]
    return {"before": summary["eval_reward_before"], "after": summary["eval_reward_after"],
            "roles_before": {r: f["reward"] for r, f in first["roles"].items()},
            "roles_after": {r: f["reward"] for r, f in last["roles"].items()},
            "curve": [[e["step"], e["reward"]] for e in summary["evals"]], "seconds": round(time.monotonic() - started)}


def main(seeds: str = typer.Option("0,1,2", help="Comma-separated."), steps: int = 16) -> None:
    seeds = [int(s) for s in seeds.split(",")]
    runs: dict[str, dict[int, dict]] = {v: {} for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-team-") as tmp:
        with LocalServer(Path(tmp) / "data") as server:
            for seed in seeds:
                for variant, extra in VARIANTS.items():
                    runs[variant][seed] = r = train(server.url, f"{variant}-s{seed}", Path(tmp) / f"{variant}-{seed}",
                                                    steps, seed, extra)
                    print(f"{variant} seed {seed}: {r['before']:.3f} -> {r['after']:.3f} ({r['seconds']}s)",
                          file=sys.stderr, flush=True)
    figures = {v: {"before": mean_se([r["before"] for r in rs.values()]),
                   "after": mean_se([r["after"] for r in rs.values()]),
                   "rise": mean_se([r["after"] - r["before"] for r in rs.values()]), "seeds": rs}
               for v, rs in runs.items()}
    both = figures["both"]["after"]["mean"]
    print(json.dumps({"example": "shop_team", "steps": steps, "seeds": seeds, "variants": figures,
                      "both_rise": figures["both"]["rise"]["mean"] > 0,
                      "both_beats_each_alone": all(both > figures[v]["after"]["mean"]
                                                   for v in ("assistant_only", "clerk_only"))}))


if __name__ == "__main__":
    typer.run(main)
