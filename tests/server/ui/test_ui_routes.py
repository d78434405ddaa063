"""The web UI's JSON routes over HTTP: filters, group ordering, and the page's own files."""

from __future__ import annotations

import json

import httpx
import pytest

from client import TrainableModel, Trajectory, TrajectoryGroup
from tests.helpers import get_json

RUN = "ui-routes"


def _traj(reward: float, item: str, sku: str, **metadata) -> Trajectory:
    """A hand-written demo-like rollout: the filters only read messages, rewards and metadata."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_price", "arguments": json.dumps({"item": item, "sku": sku})}}
    return Trajectory(messages_and_choices=[
        {"role": "system", "content": "You are a shop assistant."},
        {"role": "user", "content": f"How much does a {item} cost?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"item": item, "price": 7})},
        {"role": "assistant", "content": f"The {item} costs 7 dollars."},
    ], reward=reward, metadata=metadata, metrics={"turns": 2})


@pytest.fixture(scope="module")
async def logged(server) -> str:
    model = await TrainableModel(RUN).register(server.url)
    apples = TrajectoryGroup(trajectories=[_traj(r, "apple", f"A-{i}", task_id="t1", kind="price")
                                           for i, r in enumerate([0.0, 1.0, 0.5])])
    pears = TrajectoryGroup(trajectories=[_traj(0.2, "pear", "X-42_b", task_id="t2", kind="price", hard=True),
                                          _traj(0.2, "pear", "P-1", task_id="t2", kind="price", hard=False)])
    await model.log([apples, pears], split="val", step=0)
    # A NaN figure (which the server accepts as JSON's NaN literal) must not break listing or
    # responses; the client library would refuse to send it, so it goes as raw JSON.
    odd = _traj(0.9, "plum", "Q-9", task_id="t3", kind="stock")
    odd.metrics["ratio"] = float("nan")
    body = {"groups": [{"trajectories": [odd.model_dump(mode="json")]}], "split": "probe", "step": 1}
    r = httpx.post(f"{server.url}/v1/runs/{RUN}/log", content=json.dumps(body, allow_nan=True),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    return server.url


def _rewards(url: str, **params) -> list[float]:
    return sorted(t["reward"] for t in get_json(url, f"/ui/api/runs/{RUN}/trajectories", **params)["data"])


def test_runs_and_run_report_rewards_per_split(logged):
    runs = {r["name"]: r for r in get_json(logged, "/ui/api/runs")["data"]}
    assert runs[RUN]["last_eval_reward"] == pytest.approx((0 + 1 + 0.5 + 0.2 + 0.2) / 5)
    assert runs[RUN]["last_reward"] is None  # nothing trained: no train curve to report
    run = get_json(logged, f"/ui/api/runs/{RUN}")
    assert [p["step"] for p in run["rewards"]["val"]] == [0] and run["rewards"]["val"][0]["n"] == 5
    assert run["rewards"]["probe"][0]["reward_mean"] == pytest.approx(0.9)


def test_trajectory_filters_combine(logged):
    assert _rewards(logged) == [0.0, 0.2, 0.2, 0.5, 0.9, 1.0]
    assert _rewards(logged, min_reward=0.5) == [0.5, 0.9, 1.0]
    assert _rewards(logged, max_reward=0.2) == [0.0, 0.2, 0.2]
    assert _rewards(logged, min_reward=0.1, max_reward=0.6, step=0) == [0.2, 0.2, 0.5]
    assert _rewards(logged, step=1) == [0.9] and _rewards(logged, split="probe") == [0.9]
    assert _rewards(logged, split="val", group=1) == [0.2, 0.2]
    # metadata: strings, booleans by their JSON spelling; the key is matched, never parsed as a path
    assert _rewards(logged, meta_key="task_id", meta_value="t1") == [0.0, 0.5, 1.0]
    assert _rewards(logged, meta_key="hard", meta_value="true") == [0.2]
    assert _rewards(logged, meta_key="kind", meta_value="stock") == [0.9]
    assert _rewards(logged, meta_key="kind", meta_value="nope") == []
    assert _rewards(logged, meta_key="$.kind", meta_value="stock") == []
    # text: case-insensitive, over message contents and tool-call arguments, LIKE wildcards literal
    assert _rewards(logged, q="PEAR COSTS") == [0.2, 0.2]
    assert _rewards(logged, q="x-42_b") == [0.2]
    assert _rewards(logged, q="x-42%") == [] and _rewards(logged, q="A_0") == []
    assert _rewards(logged, q="pear", min_reward=0.5) == []
    listed = get_json(logged, f"/ui/api/runs/{RUN}/trajectories", step=1)["data"][0]
    assert listed["metrics"]["ratio"] is None and listed["metadata"]["task_id"] == "t3"
    assert "data" not in listed  # summaries only: no messages or tokens
    page = get_json(logged, f"/ui/api/runs/{RUN}/trajectories", limit=2)
    assert len(page["data"]) == 2 and page["truncated"]


def test_step_groups_widest_spread_first_and_one_trajectory(logged):
    groups = get_json(logged, f"/ui/api/runs/{RUN}/steps/0/groups", split="val")["data"]
    assert [g["group_index"] for g in groups] == [0, 1]
    apples, pears = groups
    assert apples["spread"] == pytest.approx(1.0) and apples["mean"] == pytest.approx(0.5)
    assert pears["spread"] == 0 and pears["n"] == 2
    assert pears["metadata"] == {"task_id": "t2", "kind": "price"}  # `hard` differs, so it is not the task's
    traj = get_json(logged, f"/ui/api/trajectories/{apples['trajectories'][1]['id']}")
    assert traj["reward"] == 1.0 and traj["run"] == RUN
    assert traj["data"]["messages_and_choices"][2]["tool_calls"][0]["function"]["name"] == "get_price"
    assert get_json(logged, f"/ui/api/runs/{RUN}/steps/0/groups", split="train")["data"] == []


def test_unknown_things_are_404(logged):
    for path in ("/ui/api/runs/nope", "/ui/api/runs/nope/trajectories", "/ui/api/runs/nope/attempts",
                 "/ui/api/trajectories/999999",
                 "/ui/static/missing.js", "/ui/static/..%2Fapi%2Fui_routes.py"):
        r = httpx.get(logged + path, timeout=30)
        assert r.status_code == 404, path
    r = httpx.get(logged + f"/ui/api/runs/{RUN}/trajectories", params={"min_reward": "high"}, timeout=30)
    assert r.status_code == 400


def test_page_and_its_files_are_served_with_a_strict_policy(logged):
    r = httpx.get(logged + "/ui", follow_redirects=True, timeout=30)
    assert r.status_code == 200 and str(r.url).endswith("/ui/")
    assert "text/html" in r.headers["content-type"] and 'src="static/app.js"' in r.text
    assert "script-src 'self'" in r.headers["content-security-policy"]
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{logged}/ui/static/{name}", timeout=30)
        assert r.status_code == 200 and kind in r.headers["content-type"], name


async def test_an_attempt_that_trains_nothing_is_listed_with_its_warnings(logged):
    """Plain assistant dicts are context, not training data: the job trains nothing, and the run's
    attempts say so in the words the job's result used."""
    model = await TrainableModel(RUN).register(logged)
    group = TrajectoryGroup(trajectories=[_traj(0.0, "fig", "F-1"), _traj(1.0, "fig", "F-2")])
    result = await model.train([group])
    assert not result.trained and result.step == 0
    body = get_json(logged, f"/ui/api/runs/{RUN}/attempts")
    assert body["run"] == RUN
    [attempt] = body["data"]
    assert (attempt["trained"], attempt["outcome"], attempt["step"], attempt["kind"]) == (False, "untrained", 1, "rl")
    assert attempt["job_id"] == result.job_id and attempt["warnings"] == result.warnings
    assert any("no Choice objects" in w for w in attempt["warnings"])
    assert attempt["metrics"]["groups_total"] == 1 and attempt["metrics"]["trainable_tokens"] == 0
    assert get_json(logged, f"/ui/api/runs/{RUN}")["steps"] == []  # an attempt is not a step
