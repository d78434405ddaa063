"""kill -9 during a training step: the restarted server resumes every run at its last complete
step, the store still holds every completed step, and the next step gives the same result as
if nothing had happened."""

from __future__ import annotations

import json
import random
import time

import httpx

from client import TrainConfig, TrainableModel, TrajectoryGroup
from tests.helpers import adapter_weights, demo_groups

CONFIG = TrainConfig(learning_rate=1e-3)


def _rewarded(groups: list[TrajectoryGroup], seed: int) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    return [TrajectoryGroup(trajectories=[t.model_copy(update={"reward": rng.random()}) for t in g.trajectories])
            for g in groups]


async def _wait_for_event(url: str, job_id: str, kind: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["type"] == kind:
                    return


async def test_sigkill_mid_step_resumes_at_last_complete_step(fresh_server, tmp_path):
    reference = fresh_server(data_dir=tmp_path / "reference")
    crashy_dir = tmp_path / "crashy"
    crashy = fresh_server(data_dir=crashy_dir)

    ref = await TrainableModel("crash").register(reference.url)
    small = _rewarded(await demo_groups(ref, 2, 4, seed=11), seed=1)
    big = _rewarded(await demo_groups(ref, 8, 6, seed=12), seed=2)
    # the reference run: two steps, nothing happens
    await ref.train(small, CONFIG, idempotency_key="k1")
    await ref.train(big, CONFIG, idempotency_key="k2")

    model = await TrainableModel("crash").register(crashy.url)
    first = await model.train(small, CONFIG, idempotency_key="k1")
    body = {"kind": "rl", "groups": [g.model_dump(mode="json") for g in big], "config": CONFIG.model_dump(),
            "idempotency_key": "k2"}
    job = (await model.request("POST", "/v1/runs/crash/jobs", json=body))["job_id"]
    await _wait_for_event(crashy.url, job, "started")
    time.sleep(0.3)
    crashy.kill()  # SIGKILL, mid-step

    restarted = fresh_server(data_dir=crashy_dir)
    model = await TrainableModel("crash").register(restarted.url)
    step = await model.get_step()
    status = (await model.request("GET", f"/v1/jobs/{job}"))["status"]
    assert (step, status) in ((1, "interrupted"), (2, "succeeded")), (step, status)
    # every completed step is in the store, with its trajectories
    run = await model.request("GET", "/v1/runs/crash")
    assert [s["step"] for s in run["steps"]][:1] == [1]
    assert run["steps"][0]["metrics"]["trainable_tokens"] == first.metrics.trainable_tokens
    stored = (await model.request("GET", "/v1/runs/crash/trajectories", params={"step": 1}))["data"]
    assert len(stored) == sum(len(g.trajectories) for g in small)
    assert any(isinstance(i, dict) and i.get("token_ids") for i in stored[0]["data"]["messages_and_choices"])
    # resubmitting the same key finishes the step once, with the same weights as the reference
    result = await model.train(big, CONFIG, idempotency_key="k2")
    assert result.step == 2 and await model.get_step() == 2
    expected = adapter_weights(tmp_path / "reference", "crash", 2)
    got = adapter_weights(crashy_dir, "crash", 2)
    assert expected.keys() == got.keys()
    worst = max(float((expected[k] - got[k]).abs().max()) for k in expected)
    assert worst <= 1e-6, f"resumed step differs from the uninterrupted one by {worst}"
