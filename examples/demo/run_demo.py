"""`make demo`: start art-server on the embedded model, train the demo agent, show the result.

The server runs as a separate process, as it would on a GPU box; the training loop is the
ordinary `python -m client.train` CLI talking to it over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import typer

ROOT = Path(__file__).resolve().parents[2]

# Tuned on the 2-core CPU: enough steps for held-out reward to pass 0.85 within the 10 minutes.
DEMO_ARGS = ["--example", "demo", "--steps", "12", "--groups-per-step", "8", "--group-size", "8",
             "--eval-every", "4", "--eval-tasks", "64", "--learning-rate", "2e-3"]


def main(port: int = 8765, out: Path = Path("out/demo"), steps: int = typer.Option(None)) -> None:
    out = out.resolve()
    data = out / "server-data"
    shutil.rmtree(data, ignore_errors=True)  # the demo always starts from the untrained model
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = open(out / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "--port", str(port), "--data-dir", str(data),
                               "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                raise SystemExit(f"art-server exited; see {out / 'server.log'}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        print(f"art-server up on {url} after {time.time() - started:.1f}s", flush=True)
        args = list(DEMO_ARGS)
        if steps is not None:
            args[args.index("--steps") + 1] = str(steps)
        cmd = [sys.executable, "-m", "client.train", "--server", url, "--run", "demo", "--out", str(out), *args]
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        if rc != 0:
            raise SystemExit(rc)
    finally:
        server.terminate()
        server.wait()
    summary = json.loads((out / "summary.json").read_text())
    total = time.time() - started
    print(f"\nheld-out reward {summary['eval_reward_before']:.3f} -> {summary['eval_reward_after']:.3f} "
          f"in {summary['steps']} steps, {total:.0f}s including server start; plot: {out / 'reward.png'}")
    (out / "demo.json").write_text(json.dumps({**{k: summary[k] for k in ("eval_reward_before", "eval_reward_after",
                                                                           "steps")}, "seconds_total": total}))


if __name__ == "__main__":
    typer.run(main)
