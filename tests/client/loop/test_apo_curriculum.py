"""TinyZero's two ideas as options: A*-PO (Brantley et al. 2025) and a curriculum.

The pure pieces (V*, the curriculum's rule) on their own; then against a real art-server on the
embedded model: an A*-PO step trains groups of one on their given V* (and a submission without
it is a 400 that says so), and `client.train --curriculum` raises its level on a real run when
held-out success passes the threshold (with a scripted reward: the mechanism, not learning).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import httpx
import pytest

from client import TrainConfig, TrainableModel, TrajectoryGroup
from client.loop.apo import ValueTable, optimal_value, solved
from client.loop.curriculum import Curriculum, next_level, success_rate
from client.errors import ConfigError
from client.loop.training_loop import train_loop
from client.loop.config import LoopConfig
from client.train import loop_config
from protocol.trajectory import History
from examples.demo import task as demo
from rollouts.agent import rollout
from rollouts.env import Environment, Example, RolloutSettings, Score, Task, ToolError


# ---- pure functions ---------------------------------------------------------------------------

@pytest.mark.unit
def test_optimal_value_lies_between_the_mean_and_the_best_reward():
    rewards = [0.0, 0.0, 0.0, 1.0]
    v = optimal_value(rewards, 0.5)
    assert v == pytest.approx(0.5 * math.log((3 + math.exp(2)) / 4))
    assert 0.25 < v < 1.0
    assert optimal_value(rewards, 1e4) == pytest.approx(0.25, abs=1e-3)  # beta -> inf: the mean
    assert optimal_value(rewards, 1e-3) == pytest.approx(1.0, abs=2e-3)  # beta -> 0: the max, no overflow
    assert optimal_value([0.0] * 8, 0.5) == 0.0
    assert optimal_value([-1.1, -1.0], 0.5) < 0  # shaped rewards below 0 give a negative V*, as in the post-mortem
    with pytest.raises(ValueError):
        optimal_value([], 0.5)


@pytest.mark.unit
async def test_unsolved_prompts_are_skipped_and_counted_and_failed_samples_never_score_zero():
    table = ValueTable(samples=3, beta=0.5, skip_unsolved=True)
    from protocol.trajectory import Trajectory

    async def ref(rewards, exceptions=0):
        return TrajectoryGroup(trajectories=[Trajectory(reward=r) for r in rewards],
                               exceptions=["ConnectionError: down"] * exceptions)

    easy = await table.get("easy", lambda n: ref([1.0, 0.0], exceptions=1))
    assert easy.value == pytest.approx(optimal_value([1.0, 0.0], 0.5))  # the failed sample is not a 0
    assert table.trainable(easy)
    hard = await table.get("hard", lambda n: ref([0.0, 0.0, 0.0]))
    assert not table.trainable(hard)
    down = await table.get("down", lambda n: ref([], exceptions=3))
    assert down.value is None and not table.trainable(down) and len(down.errors) == 3
    again = await table.get("easy", lambda n: pytest.fail("a prompt's V* is estimated once"))
    assert again is easy
    # an outage is not the prompt's: once the server is back, the prompt is estimated again
    back = await table.get("down", lambda n: ref([1.0, 1.0, 0.0]))
    assert back.usable and table.trainable(back)
    f = table.figures()
    assert f["value_prompts"] == 3 and f["value_samples"] == 9 and f["value_samples_failed"] == 1
    assert f["value_prompts_unsolved"] == 1 and f["value_estimates_failed"] == 1
    assert f["value_draws_skipped_unsolved"] == 1
    defaults = LoopConfig()
    assert ValueTable(defaults.value_samples, defaults.value_beta, skip_unsolved=False).trainable(hard)
    assert solved([0.0, 0.2]) and not solved([0.0, -1.0])


@pytest.mark.unit
def test_the_curriculum_climbs_one_level_at_a_time_and_never_past_the_top():
    assert success_rate([1.0, 0.0, 1.0, 1.0]) == 0.75
    assert success_rate([0.9, 1.0], success_at=0.9) == 1.0
    assert success_rate([]) is None
    assert next_level(0, 0.8, 0.8, 3) == 1
    assert next_level(0, 0.79, 0.8, 3) == 0
    assert next_level(2, 1.0, 0.8, 3) == 2  # the top level
    assert next_level(1, None, 0.8, 3) == 1  # nothing measured: no move
    c = Curriculum(threshold=0.8, every=25)
    assert [s for s in range(0, 80) if c.due(s)] == [25, 50, 75]
    with pytest.raises(ValueError):
        Curriculum(threshold=0.0)


@pytest.mark.unit
def test_the_command_line_refuses_what_cannot_work():
    base = dict(server="http://127.0.0.1:1", api_key=None, run="r", project="default", example="demo", steps=1,
                groups_per_step=1, group_size=1, eval_every=0, eval_tasks=1, seed=0, out="out", reward="env",
                judge=None, progress=False, patience=1, max_steps_off_policy=0, rollout_overrides={})
    cfg = loop_config(**base, train={"loss": "apo"}, curriculum={"threshold": 0.5, "every": 2, "eval_tasks": 4})
    assert cfg.train.baseline == "given" and cfg.curriculum.every == 2
    assert loop_config(**base, train={"loss": "importance_sampling", "baseline": "leave_one_out"}).train.baseline \
        == "leave_one_out"
    for train, curriculum, needle in (({"loss": "ppo", "baseline": "v"}, None, "--baseline"),
                                      ({"loss": "apo", "baseline": "group_mean"}, None, "given"),
                                      ({"loss": "ppo"}, {"threshold": 2.0, "every": 1, "eval_tasks": 1},
                                       "--curriculum")):
        with pytest.raises(ConfigError, match=needle):
            loop_config(**base, train=train, curriculum=curriculum)


@pytest.mark.unit
def test_scale_rewards_is_refused_where_it_would_be_ignored():
    assert TrainConfig(scale_rewards=True).baseline == "group_mean"
    for baseline, loss in (("leave_one_out", "importance_sampling"), ("given", "apo")):
        with pytest.raises(ValueError, match="scale_rewards"):
            TrainConfig(scale_rewards=True, baseline=baseline, loss=loss)


# ---- against a real server --------------------------------------------------------------------

async def _singles(model: TrainableModel, n: int) -> list[TrajectoryGroup]:
    """n groups of one real rollout each of the demo task, sampled from the server."""
    example = demo.make_example()
    async with model.openai_client(max_retries=0) as client:
        trajs = await asyncio.gather(*(rollout(client, model.name, example.make_env(t), t,
                                               RolloutSettings(max_turns=2, max_tokens=24, temperature=1.0, seed=i))
                                       for i, t in enumerate(example.train_tasks(0)[:n])))
    return [TrajectoryGroup(trajectories=[t]) for t in trajs]


async def test_an_apo_step_trains_groups_of_one_on_their_given_value(server):
    model = await TrainableModel("apo-step").register(server.url)
    groups = await _singles(model, 3)
    rewards = [1.0, 0.0, 1.0]
    values = [0.4, 0.6, 0.9]
    for g, r, v in zip(groups, rewards, values):
        g.trajectories[0].reward, g.value = r, v
    # the same groups under GRPO: every one is a group of one, dropped, nothing trained
    plain = await model.train(groups, TrainConfig(learning_rate=1e-3))
    assert not plain.trained and plain.metrics.groups_dropped_single == 3
    result = await model.train(groups, TrainConfig(loss="apo", learning_rate=1e-3))
    m = result.metrics
    assert result.trained and result.step == 1
    assert m.groups_trainable == 3 and m.groups_dropped_single == 0 and m.prompt_mismatches == 0
    assert m.baseline == "given" and m.loss_name == "apo"
    assert m.value_mean == pytest.approx(sum(values) / 3)
    assert m.advantage_mean == pytest.approx(sum(r - v for r, v in zip(rewards, values)) / 3)
    assert m.advantage_positive_fraction == pytest.approx(2 / 3)
    assert m.lora_update_norm > 0 and m.loss > 0
    # REINFORCE with the given value as its baseline trains groups of one too
    again = await _singles(model, 2)
    for g in again:
        g.trajectories[0].reward, g.value = 1.0, 0.25
    rf = await model.train(again, TrainConfig(loss="importance_sampling", baseline="given", learning_rate=1e-3))
    assert rf.trained and rf.metrics.groups_trainable == 2 and rf.metrics.advantage_mean == pytest.approx(0.75)
    # every sample below its value: trained, and told that nothing was better than V*
    low = await _singles(model, 2)
    for g in low:
        g.trajectories[0].reward, g.value = 0.0, 0.5
    told = await model.train(low, TrainConfig(loss="apo", learning_rate=1e-3))
    assert told.trained and any("No trained sample scored above its given value" in w for w in told.warnings)

    # a response assembled into two sequences (here a second history) has no one log-ratio to regress
    split = await _singles(model, 1)
    traj = split[0].trajectories[0]
    async with model.openai_client() as client:  # a sub-agent's turn, sampled by the server
        sub = await client.chat.completions.create(model=model.name, max_tokens=4,
                                                   messages=[{"role": "user", "content": "Summarise."}])
    traj.additional_histories.append(History(messages_and_choices=[
        {"role": "user", "content": "Summarise."}, sub.choices[0]]))
    split[0].value = 0.5
    with pytest.raises(Exception, match="regresses one log-ratio per response.*assembles into 2 sequences"):
        await model.train(split, TrainConfig(loss="apo", learning_rate=1e-3))

    body = {"kind": "rl", "groups": [g.model_dump(mode="json") for g in groups], "config": {"loss": "apo"}}
    body["groups"][1]["value"] = None
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post("/v1/runs/apo-step/jobs", json=body)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "groups[1] has none" in msg and "V*" in msg
        body["config"] = {"loss": "apo", "baseline": "group_mean"}
        r = await http.post("/v1/runs/apo-step/jobs", json=body)
        assert r.status_code == 400 and "given" in r.json()["error"]["message"]
    assert await model.get_step() == 3  # the refused submissions trained nothing


class _LevelEnv(Environment):
    """One question. Held-out tasks are scripted by level (level 0 always solved, others never);
    a training task's reward is 0 or 1 by the parity of the reply's length, so samples differ
    from their V* and the steps have a gradient."""

    def __init__(self, task: Task):
        self.level, self.held_out = task.metadata["level"], task.id.startswith("e")

    def initial_messages(self):
        return [{"role": "system", "content": "You are a shop assistant."},
                {"role": "user", "content": "What is the price of apple?"}]

    async def call_tool(self, name, arguments):
        raise ToolError("no tools")

    async def score(self, messages) -> Score:
        if self.held_out:
            return Score(reward=1.0 if self.level == 0 else 0.0)
        return Score(reward=float(len(messages[-1].get("content") or "") % 2))


@dataclass
class _LevelExample(Example):
    def levels(self) -> int:
        return 3

    def train_tasks(self, seed: int) -> list[Task]:
        return [Task(id=f"t{i}", metadata={"level": self.level}) for i in range(4)]

    def eval_tasks(self) -> list[Task]:
        return [Task(id=f"e{i}", metadata={"level": self.level}) for i in range(4)]

    def make_env(self, task: Task) -> Environment:
        return _LevelEnv(task)


async def test_the_curriculum_raises_the_level_on_a_real_run_when_success_passes_the_threshold(server, tmp_path):
    """A*-PO with groups of one and a check every step: level 0's held-out success is 1.0 >= 0.9,
    so the level goes up after step 1, and step 2 draws its tasks from level 1; level 1's success
    is 0, so it stays. Every step's record says the level it drew from."""
    example = _LevelExample(name="levels", settings=RolloutSettings(max_turns=1, max_tokens=6, temperature=1.0))
    cfg = LoopConfig(server=server.url, run="curriculum", example="unused", steps=3, groups_per_step=2, group_size=1,
                     eval_every=0, eval_tasks=2, out=tmp_path, progress=False, patience=2,
                     train=TrainConfig(loss="apo", learning_rate=1e-4), value_samples=2, skip_unsolved=False,
                     curriculum=Curriculum(threshold=0.9, every=1, eval_tasks=4))
    summary = await train_loop(cfg, example)
    history = summary["history"]
    assert [h["step"] for h in history] == [1, 2, 3] and all(h["trained"] for h in history)
    assert [h["curriculum_level"] for h in history] == [0, 1, 1]
    assert [h["level_after"] for h in history] == [1, 1, 1]
    assert history[1]["level_success"] == 0.0 and history[0]["level_success"] is None  # measured at level 0, left
    assert history[0]["value_prompts"] >= 1 and 0.0 <= history[0]["value_estimated_mean"] <= 1.0
    assert history[0]["value_mean"] is not None  # the server's: over the groups it trained
    assert history[-1]["groups_dropped_single"] == 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["history"][-1]["curriculum_level"] == 1
