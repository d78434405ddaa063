"""`bench/trajectory_walk.py --baseline REV`, end to end: the walk here and at a commit, the
commit's walked from a worktree of its own, which is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

from client.local_server import ROOT


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_the_walk_at_a_baseline_commit_is_counted_from_that_commits_own_files():
    worktrees = git("worktree", "list")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "trajectory_walk.py"), "--baseline", "HEAD"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    base = line["baseline"]
    assert base["rev"] == git("rev-parse", "--short", "HEAD").strip()
    # A walk of the worktree with another tree's packages imported would find no function of the
    # worktree's own files: none of these could be counted.
    assert base["functions"] > 100 and base["modules"] > 20 and base["moves"] > base["returns"] > 0
    assert set(base) == {"rev", "functions", "moves", "returns", "modules", "returns_per_function",  # no names
                         "returns_one_module_per_package", "returns_one_module_per_top_package"}
    assert base["returns"] >= base["returns_one_module_per_package"] >= base["returns_one_module_per_top_package"]
    assert line["returns_vs_baseline"] == round(line["read"]["returns"] / base["returns"], 2)
    assert line["step"] == 1 and line["read"]["max_doors"] >= 1
    assert git("worktree", "list") == worktrees
