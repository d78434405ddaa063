"""`make demo`: start art-server on the embedded model, train the demo agent, show the result.

The server runs as a separate process, as it would on a GPU box; the training loop is the
ordinary `python -m client.train` CLI talking to it over HTTP.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import typer

from client.local_server import ROOT, LocalServer

# One optimizer step per batch of 16 groups at the embedded model's learning rate (2e-3): faster
# settings (3e-3, or 8 groups per step) can teach the model a malformed tool call that every rollout
# then repeats (see the README).
# --keep-best: a run that peaks before its last step (0.938 at step 8, 0.812 at 16, in one of three
# runs) ends serving its peak, as a user would deploy it.
DEMO_ARGS = ["--example", "demo", "--steps", "16", "--groups-per-step", "16", "--group-size", "8",
             "--eval-every", "4", "--eval-tasks", "64", "--keep-best"]


def result_line(summary: dict, seconds: float, plot: Path) -> str:
    """The demo's last word: held-out reward before and after, and the step its name serves when
    --keep-best pinned an earlier one."""
    pinned = summary.get("keep_best")
    serves = (f" (the run serves step {pinned['serving_step']}, its best: {pinned['reward']:.3f})" if pinned else "")
    return (f"held-out reward {summary['eval_reward_before']:.3f} -> {summary['eval_reward_after']:.3f}{serves} "
            f"in {summary['steps']} steps, {seconds:.0f}s including server start; plot: {plot}")


def main(port: int = 8765, out: Path = Path("out/demo"), steps: int = typer.Option(None)) -> None:
    out = out.resolve()
    data = out / "server-data"
    shutil.rmtree(data, ignore_errors=True)  # the demo always starts from the untrained model
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with LocalServer(data, log=out / "server.log", port=port) as server:
        print(f"art-server up on {server.url} after {time.time() - started:.1f}s", flush=True)
        args = list(DEMO_ARGS)
        if steps is not None:
            args[args.index("--steps") + 1] = str(steps)
        cmd = [sys.executable, "-m", "client.train", "--server", server.url, "--run", "demo", "--out", str(out), *args]
        rc = subprocess.call(cmd, cwd=ROOT)
        if rc != 0:
            raise SystemExit(rc)
    summary = json.loads((out / "summary.json").read_text())
    total = time.time() - started
    print("\n" + result_line(summary, total, out / "reward.png"))
    # The server stops with the demo; its data dir keeps the run for the web UI.
    print(f"browse the run: art-server --data-dir {data} --port 8000, then http://127.0.0.1:8000/ui/")
    (out / "demo.json").write_text(json.dumps({**{k: summary[k] for k in ("eval_reward_before", "eval_reward_after",
                                                                           "steps")}, "seconds_total": total}))


if __name__ == "__main__":
    typer.run(main)
