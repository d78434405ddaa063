"""End to end, as a user runs it: `python -m client.train` on a laptop against a real art-server,
training the demo agent until its held-out reward rises."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_client_train_raises_held_out_reward(fresh_server, tmp_path):
    srv = fresh_server()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "client.train", "--server", srv.url, "--run", "e2e", "--example", "demo",
           "--steps", "6", "--groups-per-step", "8", "--group-size", "8", "--eval-every", "3",
           "--eval-tasks", "48", "--learning-rate", "2e-3", "--num-minibatches", "4", "--epochs", "2",
           "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step   1 | reward" in proc.stdout and "logprob_gap" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_reward_before", "eval_reward_after", "steps", "seconds"} <= set(summary)
    assert summary["steps"] == 6
    assert (out / "reward.png").stat().st_size > 1000
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    print(f"held-out reward {before:.3f} -> {after:.3f} in {summary['seconds']:.0f}s")
    assert after >= before + 0.25, f"held-out reward did not rise: {before:.3f} -> {after:.3f}"

    # restarting the same command resumes at the run's step instead of starting over
    proc = subprocess.run(cmd[:cmd.index("--steps") + 1] + ["7"] + cmd[cmd.index("--steps") + 2:], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step   7 |" in proc.stdout and "step   1 |" not in proc.stdout
