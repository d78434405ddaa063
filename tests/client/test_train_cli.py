"""`python -m client.train` around its steps, against a real server: a server killed and restarted
while the run samples, and Ctrl-C.

A user's run exited 1 about 20 s after its server was killed, with "64 of 64 rollouts failed ...
Connection error", although its training calls wait out a restart; and Ctrl-C exited in silence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from client.errors import ServerUnreachable
from client.outage import ServerWatch, connection_failure
from conftest import ServerProcess
from tests.conftest import ROOT, free_port

OUTAGE = 30.0  # seconds the server stays down: longer than a rollout's own retries (~8 s) and patience's 3 tries


def _start(srv, out, run: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "client.train", "--server", srv.url, "--run", run, "--example", "demo",
           "--out", str(out), "--no-progress", "--eval-every", "0", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})


def _read_until(proc: subprocess.Popen, prefix: str, seen: list[str]) -> None:
    """Read `proc`'s stdout into `seen` up to the first line that starts with `prefix`."""
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line {prefix!r}: {''.join(seen)[-2000:]}{proc.stderr.read()[-2000:]}")


def test_a_run_whose_server_is_killed_while_it_samples_waits_and_finishes(tmp_path):
    first = ServerProcess(tmp_path / "data").start()
    again = ServerProcess(tmp_path / "data", port=first.port)
    out = tmp_path / "out"
    proc = _start(first, out, "outage", "--steps", "2", "--groups-per-step", "4", "--group-size", "4",
                  "--eval-tasks", "8", "--max-tokens", "48", "--retry-seconds", "240")
    try:
        seen: list[str] = []
        _read_until(proc, "eval @ step 0", seen)  # the first batch's rollouts start now
        first.kill()  # SIGKILL, mid-sampling
        restart = threading.Timer(OUTAGE, again.start)
        restart.start()
        stdout, stderr = proc.communicate(timeout=600)
        restart.join()
    finally:
        proc.kill()
        first.stop()
        again.stop()
    stdout = "".join(seen) + stdout
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # said once, with how long it waits, instead of counting the lost connections as failed rollouts
    assert stderr.count(f"artisan: waiting for the server at {first.url} (retrying up to 240 s") == 1, stderr
    assert "answers again after" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert not any(h.get("rollouts_failed") or h.get("trajectories_excluded") for h in summary["history"]), \
        summary["history"]
    assert "rollouts failed" not in stdout


def test_ctrl_c_says_how_to_go_on_and_exits_130(fresh_server, tmp_path):
    srv = fresh_server()
    out = tmp_path / "out"
    proc = _start(srv, out, "interrupted", "--steps", "50", "--groups-per-step", "2", "--group-size", "2",
                  "--eval-tasks", "2", "--patience", "50")
    try:
        seen: list[str] = []
        _read_until(proc, "step ", seen)
        time.sleep(1.0)  # into the next batch's rollouts
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    step = json.loads((out / "summary.json").read_text())["steps"]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"interrupted at step {step}; the same command resumes from step {step}"), stderr


async def test_a_step_the_server_trained_as_ctrl_c_came_is_in_the_summary(server, tmp_path, monkeypatch):
    """Ctrl-C between a step's answer and its record (the step line, an evaluation): the summary still
    has the step, as the interruption line does, so that the two agree."""
    import asyncio

    from client.loop import training_loop
    from client.loop.config import LoopConfig
    from client.loop.examples import load_example

    record, reached = training_loop.TrainingLoop.record, asyncio.Event()

    async def first_trained_never_recorded(self, outcome, begun):
        if outcome.result is not None and outcome.result.trained:
            reached.set()
            await asyncio.Event().wait()
        return await record(self, outcome, begun)

    monkeypatch.setattr(training_loop.TrainingLoop, "record", first_trained_never_recorded)
    cfg = LoopConfig(server=server.url, run="cut-short", example="demo", steps=5, groups_per_step=4, group_size=8,
                     eval_tasks=8, out=tmp_path, progress=False, patience=50, seed=1)
    loop = asyncio.create_task(training_loop.train_loop(cfg, load_example("demo")))
    await asyncio.wait([loop, asyncio.create_task(reached.wait())], return_when=asyncio.FIRST_COMPLETED)
    assert not loop.done(), loop
    while not loop.done():  # as Ctrl-C does (client/loop/interrupt.py): again until the loop has unwound
        loop.cancel()
        await asyncio.wait([loop], timeout=1.0)
    assert loop.cancelled()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == training_loop.RUNS_AT["cut-short"]["step"] >= 1
    assert summary["history"][-1]["interrupted"] and summary["history"][-1]["trained"]


async def test_only_a_failure_to_reach_a_server_that_is_down_waits(server):
    """A connection error while the server answers its health check is the rollout's own (a tool
    backend refused it): counted, not waited for. One while the server is down waits, for no
    longer than the retry window."""
    calls: list[int] = []

    async def refused() -> None:
        calls.append(1)
        raise RuntimeError("the tool failed") from httpx.ConnectError("connection refused")

    watch = ServerWatch(server.url, 5.0)
    with pytest.raises(RuntimeError):
        await watch.run(refused)
    assert calls == [1] and watch.outages == 0 and watch.gone is None

    said: list[str] = []
    nobody = f"http://127.0.0.1:{free_port()}"
    gone = ServerWatch(nobody, 1.0, say=said.append)
    with pytest.raises(ServerUnreachable):
        await gone.run(refused)
    assert calls == [1, 1] and gone.outages == 1 and isinstance(gone.gone, ServerUnreachable)
    assert said == [f"artisan: waiting for the server at {nobody} (retrying up to 1 s; ARTISAN_RETRY_SECONDS sets "
                    f"how long): rollouts that could not reach it will run again, not count as failed"]

    async def wrong() -> None:
        raise ValueError("a bad reply")

    with pytest.raises(ValueError):  # not a connection failure: not even a health check
        await ServerWatch(nobody, 1.0, say=said.append).run(wrong)
    assert len(said) == 1


def test_what_counts_as_not_reaching_the_server():
    request = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")
    assert connection_failure(openai.APIConnectionError(request=request))
    assert connection_failure(openai.APITimeoutError(request=request))
    assert connection_failure(httpx.ReadError("reset"))
    down = openai.InternalServerError("down", response=httpx.Response(503, request=request), body=None)
    assert connection_failure(down)
    failed = openai.InternalServerError("bug", response=httpx.Response(500, request=request), body=None)
    assert not connection_failure(failed) and not connection_failure(ValueError("no"))
