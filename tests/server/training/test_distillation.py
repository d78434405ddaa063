"""On-policy distillation: the teacher route (`POST /v1/logprobs`) and the `distill` option of an
RL job. The math is unit-tested apart; the rest runs against the real server on the embedded model
(the route on real weights: tests/server/model/test_real_models.py)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch

from client import TrainableModel
from protocol.config import Distill, SFTConfig, TrainConfig
from protocol.trajectory import Trajectory, TrajectoryGroup
from server.model.scoring import batches
from server.training import distill
from server.training.advantages import reverse_kl_advantages
from server.training.assemble import TrainSequence
from server.training.batching import make_microbatch
from server.training.steps import advantages_for
from tests.conftest import ServerProcess

QUESTION = [{"role": "user", "content": "What colour is the sky?"}]


# ---- the math (pure) ----------------------------------------------------------------------------

@pytest.mark.unit
def test_each_token_is_pushed_towards_the_teacher_by_its_log_ratio():
    assert reverse_kl_advantages([-1.0, -3.0], [-2.0, -0.5], coef=2.0) == [-2.0, 5.0]
    with pytest.raises(ValueError, match="2 student logprobs against 1"):
        reverse_kl_advantages([-1.0, -3.0], [-2.0], coef=1.0)


def _agent_turns() -> TrainSequence:
    """A prompt, a sampled turn, a tool result, another sampled turn: trained tokens at 3-4 and 7."""
    s = TrainSequence()
    s.extend([1, 2, 3], trained=False)
    s.extend([4, 5], trained=True, logprobs=[-1.0, -2.0], temperature=0.6)
    s.extend([6, 7], trained=False)
    s.extend([8], trained=True, logprobs=[-0.5], temperature=0.6)
    return s


@pytest.mark.unit
def test_only_sampled_tokens_get_the_teacher_s_advantage_and_the_step_reports_the_kl():
    seq, seen = _agent_turns(), []

    def teacher(host, name, spans):
        seen.append((name, spans))
        return [[-1.5, -1.0, -9.0, -9.0, -0.5]]  # tokens 3..7: trained at 3, 4 and 7

    kl = distill.apply(None, [seq, TrainSequence()], Distill(teacher="t", coef=2.0), teacher)
    # scored from the first trained token, at each token's sampling temperature; an empty sequence not at all
    assert seen == [("t", [(seq.ids, 3, [0.6, 0.6, 1.0, 1.0, 0.6])])]
    assert seq.token_advantages == [0.0, 0.0, 0.0, 2 * (-1.5 + 1.0), 2 * (-1.0 + 2.0), 0.0, 0.0, 2 * (-0.5 + 0.5)]
    assert kl == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0) + 0.0) / 3)
    mb = make_microbatch([seq], [0], torch.device("cpu"))
    assert mb.advantages.tolist() == pytest.approx([seq.advantage + a for a in (-1.0, 2.0, 0.0)])


@pytest.mark.unit
def test_distilling_trains_groups_the_reward_alone_would_drop():
    def group(*rewards):
        return TrajectoryGroup(trajectories=[Trajectory(reward=r) for r in rewards])

    kl_only, with_reward = TrainConfig(distill=Distill(teacher="t")), TrainConfig(distill=Distill(teacher="t",
                                                                                                  with_reward=True))
    assert advantages_for(group(1.0, 1.0), TrainConfig()).advantages is None  # constant: no signal without a teacher
    assert advantages_for(group(1.0, 1.0), kl_only).advantages == [0.0, 0.0]
    assert advantages_for(group(0.0), with_reward).advantages == [0.0]  # one rollout: the teacher still teaches it
    assert advantages_for(group(0.0, 1.0), kl_only).advantages == [0.0, 0.0]  # the reward is not read
    assert advantages_for(group(0.0, 1.0), with_reward).advantages == [-0.5, 0.5]
    assert advantages_for(group(), kl_only).advantages is None  # every rollout failed: nothing was sampled


@pytest.mark.unit
def test_distilling_needs_a_per_token_loss():
    for loss in ("apo", "awr"):
        with pytest.raises(ValueError, match="use ppo, cispo or importance_sampling"):
            TrainConfig(loss=loss, distill={"teacher": "t"})


@pytest.mark.unit
def test_scoring_batches_hold_every_sequence_once_within_the_budget():
    lengths = [5, 100, 7, 60, 3, 61]
    got = batches(lengths, max_tokens=128)
    assert sorted(i for b in got for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 or len(b) == 1 for b in got)


# ---- against the real server ------------------------------------------------------------------

def _sample(url: str, model: str, n: int, seed: int, temperature: float = 1.0) -> list:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, n=n, temperature=temperature,
                                       seed=seed, logprobs=True)
    return [(r.model_extra["prompt_token_ids"], c) for c in r.choices]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A server with a teacher run that has learnt one answer by SFT."""
    with ServerProcess(tmp_path_factory.mktemp("distill")) as srv:
        async def teach():
            teacher = await TrainableModel("teacher").register(srv.url)
            answer = [*QUESTION, {"role": "assistant", "content": "Blue, like the sea."}]
            await teacher.train_sft([answer] * 8, SFTConfig(epochs=8, learning_rate=1e-2))
        asyncio.run(teach())
        yield srv


def test_the_teacher_route_scores_a_sampled_turn_as_its_sampler_did(taught):
    """The engine's logprobs of its own sample and the route's of the same tokens: the same forward."""
    for model in ("teacher", "artisan-tiny"):
        prompt, choice = _sample(taught.url, model, 1, seed=3)[0]
        ids = choice.model_extra["token_ids"]
        r = httpx.post(taught.url + "/v1/logprobs", timeout=60, json={
            "model": model, "top_k": 4, "sequences": [{"token_ids": prompt + ids, "start": len(prompt)}]})
        assert r.status_code == 200, r.text
        got = r.json()["data"][0]
        sampled = [e.logprob for e in choice.logprobs.content]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], sampled)) <= 1e-4, (got["logprobs"], sampled)
        for lp, top, rest in zip(got["logprobs"], got["top"], got["rest"]):
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and lp <= values[0] + 1e-6
            assert math.exp(rest) + sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-4)


def test_the_teacher_route_refuses_what_it_cannot_score(taught):
    def post(body):
        return httpx.post(taught.url + "/v1/logprobs", json=body, timeout=60)

    r = post({"model": "nobody", "sequences": [{"token_ids": [1, 2]}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = post({"model": "teacher", "sequences": [{"token_ids": [1, 10**9]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sequences[0].token_ids", r.text
    r = post({"model": "teacher", "sequences": [{"token_ids": [1, 2], "start": 2}]})
    assert r.status_code == 400 and "leaves nothing to score" in r.text, r.text
    assert httpx.get(taught.url + "/health").json()["status"] == "ok"


async def test_a_student_sampled_below_temperature_1_is_at_zero_kl_from_a_teacher_equal_to_it(taught):
    """The teacher is read at the temperature the student sampled at: a fresh run (its LoRA starts
    at zero) distilled from the base model it is equal to has nothing to learn. Read at 1 against
    the student's T=0.6 logprobs, its confident tokens were pushed down (a mean KL of about 0.1 here)."""
    student = await TrainableModel("cold-student").register(taught.url)
    trajectories = [Trajectory(messages_and_choices=[*QUESTION, choice], reward=0.0)
                    for _, choice in _sample(taught.url, student.name, 8, seed=5, temperature=0.6)]
    result = await student.train([TrajectoryGroup(trajectories=trajectories)],
                                 TrainConfig(learning_rate=1e-3, distill=Distill(teacher="artisan-tiny")))
    assert abs(result.metrics.teacher_kl) < 1e-4, result.metrics.teacher_kl


async def _distill_step(student: TrainableModel, url: str, seed: int, teacher: str = "teacher"):
    trajectories = [Trajectory(messages_and_choices=[*QUESTION, choice], reward=0.0)
                    for _, choice in _sample(url, student.name, 16, seed)]
    # The embedded model's samples start far from the teacher's (a reverse KL of about 6 nats a
    # token): at 5e-3 it barely moved in 8 steps, at 2e-2 it fell to 0.6 (measured).
    config = TrainConfig(learning_rate=2e-2, distill=Distill(teacher=teacher))
    return await student.train([TrajectoryGroup(trajectories=trajectories)], config)


async def test_a_student_distilled_from_a_teacher_with_no_reward_comes_close_to_it(taught):
    student = await TrainableModel("student").register(taught.url)
    kls = []
    for step in range(12):
        result = await _distill_step(student, taught.url, seed=step)
        m = result.metrics
        assert result.trained and m.prompt_mismatches == 0 and m.groups_dropped_constant == 0, m
        kls.append(m.teacher_kl)
    print("teacher KL per step:", [round(k, 3) for k in kls])
    # Rewards were all 0: the KL taught it. It does not fall steadily: it first rises (6-7 to as much
    # as 10) while the student searches, drops to about 0.8 once its samples find the teacher's
    # answer, and can jump back to 2-5 for a step or a few when a sample strays, whose tokens the
    # teacher scores at -20. So it is judged by its best step and by the median of its second half;
    # its last two steps alone were above a third of its start on 1 of 14 seeds at 16 samples a step
    # (measured), and in one CI run at 8 samples and 8 steps (6.4 at the start, 4.3 and 0.9 at the end).
    second_half = sorted(kls[6:])
    assert kls[0] > 3.0 and min(kls) < 0.2 * kls[0] and (second_half[2] + second_half[3]) / 2 < 0.5 * kls[0], kls


async def test_a_teacher_that_cannot_score_the_student_s_tokens_is_refused_at_submission(taught, tmp_path):
    student = await TrainableModel("student-2").register(taught.url)
    with pytest.raises(Exception, match="404: teacher 'nobody' is not a model this server serves"):
        await _distill_step(student, taught.url, seed=0, teacher="nobody")

    # A run of another base model (another tokenizer): made so here by its record, as a data
    # directory shared with a SmolLM2 server would hold it.
    data = tmp_path / "data"
    with ServerProcess(data) as first:
        await TrainableModel("other").register(first.url)
    record = json.loads((data / "runs" / "other" / "run.json").read_text())
    (data / "runs" / "other" / "run.json").write_text(json.dumps(
        {**record, "base_model": "SmolLM2-135M-Instruct", "base_fingerprint": "0" * 16}))
    with ServerProcess(data) as second:
        student = await TrainableModel("student-3").register(second.url)
        with pytest.raises(Exception, match="409: teacher 'other' cannot score this run's tokens: .*SmolLM2.*another "
                                            "tokenizer"):
            await _distill_step(student, second.url, seed=0, teacher="other")


def test_client_train_distills_from_a_teacher_the_server_serves(taught, tmp_path):
    from tests.helpers import train_cli

    # One episode per task: the teacher's KL needs no siblings to compare with (bench/distill.py's student).
    proc = train_cli(taught.url, tmp_path / "out", "cli-student", "--example", "demo", "--steps", "2",
                     "--groups-per-step", "4", "--group-size", "1", "--eval-every", "0", "--eval-tasks", "4",
                     "--teacher", "teacher", "--distill-coef", "0.5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any("loss ppo, distilled from teacher (coef 0.5)" in line for line in lines), proc.stdout[:1000]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and all("| teacher KL " in line for line in steps), proc.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    trained = [h for h in summary["history"] if h["trained"]]
    assert [h["step"] for h in trained] == [1, 2]
    assert all(h["groups_trainable"] == 4 and h["groups_dropped_single"] == 0 for h in trained)
