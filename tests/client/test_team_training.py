"""Multi-agent co-training: one episode's roles, each sampled from its own run, kept in that run's
trajectory (rollouts/team.py), and trained together as one joint job (protocol/jobs.py JointJob,
server/training/jobs.py), on the real server and the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

from client import ServerError, TrainableModel
from client.team import team_groups, train_together
from protocol.choices import choice_sampling
from protocol.config import TrainConfig
from protocol.trajectory import Trajectory
from rollouts.episode import Environment, RolloutSettings, Score, Task
from rollouts.team import Seat, Team, TeamExample, TeamScore

ROOT = __import__("client.local_server", fromlist=["ROOT"]).ROOT


class Say(Environment):
    """One turn, no tools: the model answers the prompt."""

    def __init__(self, prompt: str):
        self.prompt = prompt

    def initial_messages(self):
        return [{"role": "user", "content": self.prompt}]

    async def call_tool(self, name, arguments):
        raise AssertionError("no tools")

    async def score(self, messages):
        return Score(reward=0.0)


class Relay(TeamExample):
    """The assistant speaks, the clerk answers it, the assistant speaks again: the assistant acts
    twice (one trajectory, two histories), the clerk once. Rewarded by the lengths of what was said,
    which differ from episode to episode, so that every group has something to train."""

    name, roles = "relay", ("assistant", "clerk")
    settings = RolloutSettings(max_turns=1, max_tokens=8, temperature=1.0)

    def train_tasks(self, seed):
        return [Task(id=f"t{i}", data={"prompt": f"What is the price of item {i}?"}) for i in range(4)]

    eval_tasks = train_tasks

    async def play(self, team, task):
        first = await team.act("assistant", Say(task.data["prompt"]), task)
        heard = first.messages()[-1].get("content") or ""
        answer = await team.act("clerk", Say(heard or "hello"), task)
        said = answer.messages()[-1].get("content") or ""
        await team.act("assistant", Say(said or "hello"), task)
        return TeamScore(reward=float(len(heard) % 2), roles={"clerk": float(len(said) % 2)})


def _policy_runs(t: Trajectory) -> set[str]:
    return {choice_sampling(c).policy.split("@")[0] for h in t.histories() for c in h.choices()}


@pytest.fixture
async def team(server):
    models = {r: await TrainableModel(f"relay-{r}-{server.port}-{id(object())}").register(server.url)
              for r in Relay.roles}
    yield models
    for m in models.values():
        await m.delete()


@pytest.fixture
async def seats(team):
    clients = {r: m.openai_client() for r, m in team.items()}
    yield {r: Seat(clients[r], m.name) for r, m in team.items()}
    for c in clients.values():
        await c.close()


# ---- the episode's records (pure) -----------------------------------------------------------------

@pytest.mark.unit
def test_a_role_that_acts_twice_has_one_trajectory_with_its_later_part_as_a_history():
    def part(text: str) -> Trajectory:
        return Trajectory(messages_and_choices=[{"role": "user", "content": text}], metrics={"turns": 1})

    team = Team({"a": Seat(None, "ra"), "b": Seat(None, "rb")}, RolloutSettings())
    team.parts = {"a": [part("1"), part("3")], "b": [part("2")]}
    out = team.trajectories(TeamScore(reward=1.0, roles={"b": 0.25}, metrics={"solved": True}))
    assert [h.messages()[0]["content"] for h in out["a"].histories()] == ["1", "3"]
    assert (out["a"].reward, out["b"].reward) == (1.0, 0.25)
    assert out["b"].metrics == {"turns": 1, "solved": True, "team_reward": 1.0}
    assert (out["a"].metadata["role"], out["a"].metadata["parts"]) == ("a", 2)
    assert team.parts["a"][0].additional_histories == []  # the recorded part is not changed


# ---- on the server --------------------------------------------------------------------------------

async def test_each_role_s_trajectory_holds_exactly_the_choices_its_own_run_sampled(team, seats):
    groups = await team_groups(Relay(), seats, Relay().train_tasks(0)[:2], 3, seed=5)
    for role, model in team.items():
        assert len(groups[role]) == 2 and all(len(g.trajectories) == 3 for g in groups[role])
        for t in (t for g in groups[role] for t in g.trajectories):
            assert _policy_runs(t) == {model.name}
            assert len(t.histories()) == (2 if role == "assistant" else 1)
    rewards = {r: [t.reward for g in gs for t in g.trajectories] for r, gs in groups.items()}
    assert rewards["assistant"] == [t.metrics["team_reward"] for g in groups["clerk"] for t in g.trajectories]


async def test_a_joint_job_trains_every_run_at_one_step_boundary_token_exactly(team, seats):
    groups = await team_groups(Relay(), seats, Relay().train_tasks(0), 4, seed=1)
    results = await train_together(team, groups, TrainConfig(learning_rate=1e-3), idempotency_key="joint-1")
    assert {r: (res.step, res.trained) for r, res in results.items()} == {r: (1, True) for r in team}
    assert all(res.metrics.prompt_mismatches == 0 for res in results.values())
    for role, model in team.items():
        assert await model.get_step() == 1
        async with model.http() as http:
            stream = await http.get(f"/v1/jobs/{results[role].job_id}/events", params={"after": -1})
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
        [started] = [e for e in events if e["type"] == "started"]
        assert started["data"]["with"] == [m.name for r, m in team.items() if r != role]
    # the same submission again is the same jobs: nothing trains twice
    again = await train_together(team, groups, TrainConfig(learning_rate=1e-3), idempotency_key="joint-1")
    assert {r: (res.step, res.job_id) for r, res in again.items()} == {r: (1, results[r].job_id) for r in team}


async def _greedy_logprob(model: TrainableModel) -> float:
    async with model.openai_client(max_retries=0) as client:
        resp = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, temperature=0)
    return sum(e.logprob for e in resp.choices[0].logprobs.content)


async def test_one_run_s_failed_step_rolls_every_run_of_the_joint_job_back(team, seats):
    groups = await team_groups(Relay(), seats, Relay().train_tasks(0), 4, seed=2)
    before = await _greedy_logprob(team["assistant"])
    # The clerk's update overflows to inf (weight decay lr * wd = 1e4 per optimizer step), after
    # the assistant's step computed: neither may land.
    configs = {"assistant": TrainConfig(learning_rate=1e-2),
               "clerk": TrainConfig(learning_rate=1.0, weight_decay=1e4, epochs=20)}
    with pytest.raises(ServerError, match="non-finite"):
        await train_together(team, groups, configs, idempotency_key="joint-fails")
    assert [await m.get_step() for m in team.values()] == [0, 0]
    assert await _greedy_logprob(team["assistant"]) == pytest.approx(before, abs=1e-5)  # its weights restored
    [attempt] = (await team["assistant"].request("GET", f"/ui/api/runs/{team['assistant'].name}/attempts"))["data"]
    assert attempt["outcome"] == "failed" and f"run {team['clerk'].name}'s step" in attempt["warnings"][-1]


async def test_a_bad_joint_job_is_a_clear_4xx_and_trains_nothing(team, seats, server):
    groups = await team_groups(Relay(), seats, Relay().train_tasks(0)[:1], 2, seed=3)
    job = {"groups": [g.model_dump(mode="json") for g in groups["assistant"]]}
    a, c = team["assistant"].name, team["clerk"].name
    async with httpx.AsyncClient(base_url=server.url) as http:
        missing = await http.post("/v1/joint-jobs", json={"jobs": {a: job, "no-such-run": job}})
        one = await http.post("/v1/joint-jobs", json={"jobs": {a: job}})
        own_key = await http.post("/v1/joint-jobs", json={"jobs": {a: job, c: {**job, "idempotency_key": "k"}}})
    assert missing.status_code == 404 and "no-such-run" in missing.json()["error"]["message"]
    assert one.status_code == 400 and own_key.status_code == 400
    assert "idempotency_key of its own" in own_key.text
    assert [await m.get_step() for m in team.values()] == [0, 0]


def test_client_train_runs_a_multi_agent_example_and_says_each_role(server, tmp_path):
    def train(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "client.train", "--server", server.url, "--example", "shop_team",
                               "--groups-per-step", "8", "--group-size", "8", "--eval-tasks", "4", "--eval-every", "0",
                               "--seed", "3", "--patience", "10", "--no-progress", "--out", str(tmp_path / "out"), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    bad = train("--run", "nobody", "--train-roles", "cashier", "--steps", "1")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--train-roles cashier" in bad.stderr and "assistant, clerk" in bad.stderr
    done = train("--run", f"duo-{server.port}", "--steps", "1", "--train-roles", "assistant")
    assert done.returncode == 0, done.stderr[-2000:]
    summary: dict[str, Any] = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["roles"] == {"assistant": {"run": f"duo-{server.port}-assistant", "trained": True},
                                "clerk": {"run": f"duo-{server.port}-clerk", "trained": False}}
    assert [e["step"] for e in summary["evals"]] == [0, 1] and "clerk reward" in done.stdout
    assert "(not trained: sampling only)" in done.stdout  # the clerk's line says why it did not move


async def test_each_role_s_recorded_sessions_train_its_run_in_one_joint_session_job(team):
    """A harness of two agents, each given its own run's session base URL (as a harness that cannot
    be changed is), then scored: both runs train on their own sessions at one step boundary."""
    from openai import AsyncOpenAI

    from client.team import train_sessions_together

    groups: dict[str, list[list[tuple[str, float]]]] = {r: [] for r in team}
    for task in range(2):
        for r in team:
            groups[r].append([])
        for member in range(2):
            heard = "What is the price of milk?"
            for role, model in team.items():  # the assistant speaks, the clerk answers it
                sid = f"{model.name}-{task}-{member}"
                async with AsyncOpenAI(base_url=model.session_url(sid), api_key="EMPTY") as client:
                    reply = await client.chat.completions.create(
                        model=model.name, messages=[{"role": "user", "content": heard}], max_tokens=6, seed=member)
                heard = reply.choices[0].message.content or "hello"
                groups[role][task].append((sid, float(member)))
    results = await train_sessions_together(team, groups, TrainConfig(learning_rate=1e-3), idempotency_key="sess-1")
    assert {r: (res.step, res.trained, res.metrics.prompt_mismatches) for r, res in results.items()} == \
        {r: (1, True, 0) for r in team}
    again = await train_sessions_together(team, groups, TrainConfig(learning_rate=1e-3), idempotency_key="sess-1")
    assert {r: res.job_id for r, res in again.items()} == {r: res.job_id for r, res in results.items()}
    assert [await m.get_step() for m in team.values()] == [1, 1]


async def test_a_crash_between_two_commits_keeps_the_landed_step_and_the_same_submission_trains_the_other(tmp_path):
    """The chosen semantics of a crash mid-commit: the checkpoints are the truth, per run. The first
    run's step landed and stays; the same joint submission trains only the second, once."""
    from tests.conftest import ServerProcess

    data = tmp_path / "joint-crash"
    with ServerProcess(data) as srv:
        models = {r: await TrainableModel(f"crash-{r}").register(srv.url) for r in Relay.roles}
        clients = {r: m.openai_client() for r, m in models.items()}
        groups = await team_groups(Relay(), {r: Seat(clients[r], m.name) for r, m in models.items()},
                                   Relay().train_tasks(0), 4, seed=4)
        for c in clients.values():
            await c.close()
    crashy = ServerProcess(data, env={"ARTISAN_CRASH_AT": "step_confirmed"}).start()  # after the first commit
    joint = {"jobs": {m.name: {"groups": [g.model_dump(mode="json") for g in groups[r] if g.trajectories],
                               "config": {"learning_rate": 1e-3}} for r, m in models.items()},
             "idempotency_key": "crash-1"}
    first = httpx.post(crashy.url + "/v1/joint-jobs", json=joint, timeout=60).json()["jobs"]
    assert crashy.wait_exit() != 0
    crashy.stop()
    with ServerProcess(data) as srv:
        landed, cut = (httpx.get(f"{srv.url}/v1/jobs/{first[m.name]['job_id']}").json()["status"]
                       for m in models.values())
        assert (landed, cut) == ("succeeded", "interrupted")
        for m in models.values():
            await m.register(srv.url)
        results = await train_together(models, groups, TrainConfig(learning_rate=1e-3), idempotency_key="crash-1")
        assert {r: (res.step, res.job_id) for r, res in results.items()} == \
            {r: (1, first[m.name]["job_id"]) for r, m in models.items()}
        assert [await m.get_step() for m in models.values()] == [1, 1]  # the landed one did not train twice
