"""A hang must say where it hung. A test that hangs fails on its own after the configured `timeout`
(pytest-timeout), printing its stack; and CI stopped from outside (its own time limit) prints what
each suite still running had printed so far, instead of dying with their output unread."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def test_a_hung_test_fails_with_its_stack_under_the_projects_own_config(tmp_path):
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent("""
        import time

        def test_waits_forever():
            while True:
                time.sleep(0.05)  # the line the report must show
    """))
    # The project's ini (its timeout, its plugins) with only the timeout shortened.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2",
                           str(tmp_path / "test_stuck.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Timeout" in proc.stdout and "time.sleep(0.05)" in proc.stdout, proc.stdout


def test_the_projects_timeout_is_above_its_longest_test_and_within_ci():
    timeout = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    assert 1200 <= timeout <= 2400  # the learning tests take ten minutes on a slow day; CI has 90


def test_ci_stopped_from_outside_prints_the_running_suites_output(tmp_path):
    """.ci/run as it is, with a `make` that installs at once and then hangs in every suite."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text('#!/bin/sh\necho "$1 is under way"\ncase $1 in install|env-ray) exit 0;; esac\n'
                                  'exec sleep 600\n')
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(3)  # both lanes' first suites have started and printed their lines
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for suite in ("test-fast", "envs"):
        assert f"ci: stopped while make {suite} ran" in out and f"{suite} is under way" in out, out
    assert "stopped while make install" not in out, out  # it had ended
    assert "ci: the cores were busy" in out, out
