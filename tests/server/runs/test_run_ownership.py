"""Runs belong to a base model, and one client trains a run at a time.

Two real servers on one data directory, one after the other, as a user meets them: the Quick start
on the embedded model, then `art-server --model <SmolLM2 GGUF>` on the same default data dir. The
second serves its own model and new runs, lists the old runs in one line each, and answers a
request or a registration naming one with a 409 that names both models; the old runs' files are
untouched, and the embedded model serves them again. Then leases: a second `client.train` on a
run is refused in one line, and the run is free again once the first releases it or dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess

import httpx
import openai
import pytest

from client import RunInUse, ServerError, TrainableModel
from conftest import ROOT, ServerProcess
from server.app import bounded
from server.runs.base_models import misfit
from server.runs.leases import LeaseHeld, Leases
from tests.helpers import demo_groups, train_command, with_rewards
from tests.real_models import CACHE, smollm2_gguf

HI = [{"role": "user", "content": "Hello"}]
COPIES = 30  # more runs of the other model than /health lists
NOT_SERVED = re.compile(r"^run (\S+): trained on (.+); not served by this model \((.+)\)$")


async def _train_a_step(url: str, name: str, lora: dict | None = None) -> None:
    model = await TrainableModel(name, lora=lora).register(url)
    groups = with_rewards(await demo_groups(model, 1, 2, seed=3), [[0.0, 1.0]])
    assert (await model.train(groups)).step == 1


def _chat(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 4},
                      timeout=120)


def _copy_run(data, name: str, as_name: str) -> None:
    shutil.copytree(data / "runs" / name, data / "runs" / as_name)
    record = json.loads((data / "runs" / as_name / "run.json").read_text())
    (data / "runs" / as_name / "run.json").write_text(json.dumps({**record, "name": as_name}))


async def test_runs_of_another_base_model_are_listed_refused_and_kept(tmp_path):
    data = tmp_path / "artisan-data"
    with ServerProcess(data) as tiny:  # the Quick start's model
        await _train_a_step(tiny.url, "old")
        await TrainableModel("legacy").register(tiny.url)
        await TrainableModel("garbled", lora={"rank": 8}).register(tiny.url)
    record = json.loads((data / "runs" / "old" / "run.json").read_text())
    assert record["base_model"] == "artisan-tiny" and len(record["base_fingerprint"]) == 16
    with sqlite3.connect(data / "artisan.sqlite") as db:  # run.json is the one record of it: no copy to disagree
        assert "base_model" not in [c[1] for c in db.execute("PRAGMA table_info(runs)")]

    # `legacy` as a run made before runs recorded their base model; and many of `old`
    legacy = json.loads((data / "runs" / "legacy" / "run.json").read_text())
    (data / "runs" / "legacy" / "run.json").write_text(json.dumps(
        {k: v for k, v in legacy.items() if k != "base_fingerprint"} | {"base_model": None}))
    for i in range(COPIES):
        _copy_run(data, "old", f"old-{i}")
    before = {p: p.read_bytes() for p in (data / "runs" / "old").rglob("*") if p.is_file()}

    smol = ServerProcess(data, model=smollm2_gguf(), extra=["--cache-dir", str(CACHE)]).start(timeout=600)
    try:
        response = httpx.get(smol.url + "/health")
        health, name = response.json(), response.json()["model"]
        assert name.startswith("SmolLM2")
        assert health["status"] == "degraded" and len(response.content) < 8000
        problems = health["problems"]
        assert len(problems) == 20 and problems[-1] == f"... and {COPIES + 3 - 19} more problems (see the server's log)"
        listed = {m[1]: (m[2], m[3]) for p in problems if (m := NOT_SERVED.match(p))}
        assert listed["garbled"] == ("artisan-tiny", name) and listed["legacy"] == ("artisan-tiny (the embedded model)", name)
        log = smol.log_path.read_text()
        assert "Traceback" not in log and "size mismatch" not in log
        assert sum("not served by this model" in line for line in log.splitlines()) == COPIES + 3  # one line each

        # The base model, and a new run, are served as on any server
        assert _chat(smol.url, name).status_code == 200
        await TrainableModel("fresh").register(smol.url)
        assert _chat(smol.url, "fresh").status_code == 200

        # A request or a registration that names an old run: a 409 naming both models
        client = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0)
        for model in ("old", "old@1", "legacy"):
            with pytest.raises(openai.ConflictError, match=f"trained on artisan-tiny.*this server serves {re.escape(name)}"):
                client.chat.completions.create(model=model, messages=HI, max_tokens=4)
        for path, body in (("/v1/responses", {"model": "old", "input": "Hello"}),
                           ("/v1/messages", {"model": "old@1", "max_tokens": 4, "messages": HI})):
            r = httpx.post(smol.url + path, json=body, timeout=60)
            assert r.status_code == 409 and "artisan-tiny" in r.text and name in r.text, r.text
        for run in ("old", "legacy"):
            with pytest.raises(ServerError, match=f"^409: run '{run}' was trained on artisan-tiny.*serves {re.escape(name)}"):
                await TrainableModel(run).register(smol.url)
            r = httpx.get(smol.url + f"/v1/runs/{run}")
            assert r.status_code == 409 and r.json()["error"]["code"] == "run_of_another_model"
        assert _chat(smol.url, "nonexistent").status_code == 404  # a run that is nobody's is still absent
    finally:
        smol.stop()
    assert {p: p.read_bytes() for p in (data / "runs" / "old").rglob("*") if p.is_file()} == before

    (data / "runs" / "garbled" / "run.json").write_text("{not json")
    with ServerProcess(data) as tiny:  # its own model serves it again, from the step it had
        assert _chat(tiny.url, "old@1").status_code == 200 and _chat(tiny.url, "legacy").status_code == 200
        problems = httpx.get(tiny.url + "/health").json()["problems"]
        assert any(p.startswith("run fresh: trained on SmolLM2") for p in problems)
        # A run whose run.json cannot be read: registered with a rank its checkpoints contradict, a 409
        # naming both ranks; with the rank they have, it is served again (issue 36 M6).
        assert "run garbled: its run.json cannot be read" in " ".join(problems)
        with pytest.raises(ServerError, match=r"^409: .*rank 8, not 4") as refused:
            await TrainableModel("garbled", lora={"rank": 4}).register(tiny.url)
        assert refused.value.status == 409
        await TrainableModel("garbled", lora={"rank": 8}).register(tiny.url)
        assert _chat(tiny.url, "garbled").status_code == 200
        assert "garbled" not in " ".join(httpx.get(tiny.url + "/health").json()["problems"])
    legacy = json.loads((data / "runs" / "legacy" / "run.json").read_text())
    assert legacy["base_model"] == "artisan-tiny" and legacy["base_fingerprint"] == record["base_fingerprint"]


@pytest.mark.unit
def test_checkpoint_shapes_tell_another_model_from_other_settings():
    linear = {f"model.layers.{i}.q_proj": (4, 6) for i in range(2)}
    shapes = {f"base_model.model.model.layers.{i}.q_proj.lora_{ab}.weight": s
              for i in range(2) for ab, s in (("A", (2, 4)), ("B", (6, 2)))}
    assert misfit(shapes, linear, 2, ["q_proj"]) is None
    assert misfit(shapes, linear, 3, ["q_proj"]) == ("settings", "its checkpoints have LoRA rank 2, not 3")
    assert misfit(shapes, linear, 2, ["q_proj", "v_proj"])[0] == "settings"
    assert misfit(shapes, {k: (5, 6) for k in linear}, 2, ["q_proj"])[0] == "model"  # other widths
    assert misfit(shapes, {**linear, "model.layers.2.q_proj": (4, 6)}, 2, ["q_proj"])[0] == "model"  # more layers
    assert misfit(shapes, {"model.layers.0.q_proj": (4, 6)}, 3, ["q_proj"])[0] == "model"  # before its settings


@pytest.mark.unit
def test_health_problems_are_bounded_lines():
    lines = bounded(["a\nb", "x" * 1000, *map(str, range(40))], count=20, length=300)
    assert lines[0] == "a b" and len(lines[1]) == 300 and len(lines) == 20
    assert lines[-1] == "... and 23 more problems (see the server's log)"
    assert bounded(["one"]) == ["one"]


@pytest.mark.unit
def test_a_lease_blocks_other_holders_until_released_or_expired():
    now = [0.0]
    leases = Leases(clock=lambda: now[0], wall=lambda: 0.0)
    leases.hold("r", "a" * 16, seconds=60)
    with pytest.raises(LeaseHeld, match=r"^run r is being trained by another client since \d\d:\d\d; stop it"):
        leases.hold("r", "b" * 16)
    for lease_id in ("b" * 16, None):  # another client's job, or one without a lease
        with pytest.raises(LeaseHeld):
            leases.check("r", lease_id)
    leases.check("r", "a" * 16)
    leases.check("other", None)  # an unleased run takes anyone's jobs
    now[0] = 59.0
    leases.hold("r", "a" * 16, seconds=60)  # renewed
    now[0] = 118.0
    with pytest.raises(LeaseHeld):
        leases.hold("r", "b" * 16)
    now[0] = 119.0  # expired: 60 s after the last renewal
    assert leases.hold("r", "b" * 16).id == "b" * 16
    assert not leases.release("r", "a" * 16) and leases.release("r", "b" * 16)
    leases.check("r", None)


async def test_one_client_trains_a_run_at_a_time(server):
    first = await TrainableModel("leased").register(server.url)
    second = await TrainableModel("leased").register(server.url)
    groups = with_rewards(await demo_groups(first, 1, 2, seed=4), [[0.0, 1.0]])
    async with first.lease():
        with pytest.raises(RunInUse, match=r"^run leased is being trained by another client since \d\d:\d\d; "
                                           r"stop it or use another --run"):
            async with second.lease():
                pass
        with pytest.raises(ServerError, match="^409: run leased is being trained by another client"):
            await second.train(groups)  # a job without the lease, while a client holds it
        assert (await first.train(groups)).trained  # the holder's own jobs
    async with second.lease():  # released: free at once
        assert (await second.train(groups)).step == 2
    await TrainableModel("unleased").register(server.url)


async def test_a_second_client_train_is_refused_in_one_line_and_a_killed_one_frees_the_run(server, tmp_path):
    def train(out: str) -> list[str]:
        return train_command(server.url, tmp_path / out, "busy", "--example", "demo",
                             # groups of one never train, and never end a run at once as a first batch of nothing
                             # but 0 would (client/loop/patience.py): the first client holds the run for as long
                             # as the test needs
                             "--steps", "100000", "--groups-per-step", "2", "--group-size", "1", "--eval-every", "0",
                             "--eval-tasks", "1", "--patience", "100000")

    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "ARTISAN_LEASE_SECONDS": "4"}
    first = subprocess.Popen(train("first"), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        seen = []
        for line in first.stdout:  # its first step line: it holds the lease by then
            seen.append(line)
            if line.startswith("step "):
                break
        assert first.poll() is None, "".join(seen)
        second = subprocess.run(train("second"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        assert re.fullmatch(r"error: run busy is being trained by another client since \d\d:\d\d; stop it or use "
                            r"another --run \(.*\)\n", second.stderr), second.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # no release: the lease runs out
        first.wait()

    model = await TrainableModel("busy").register(server.url)
    for _ in range(600):  # the lease was for 4 s: well within a minute
        try:
            async with model.lease():
                break
        except RunInUse:
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the killed client's lease never expired")
