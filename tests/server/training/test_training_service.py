"""The training service through its HTTP API: each invariant tried by trying to break it."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import pytest

from client import ServerError, TrainConfig, TrainableModel, TrajectoryGroup
from examples.demo import task as demo
from tests.helpers import demo_groups, with_rewards


async def test_constant_rewards_train_nothing_and_say_so(server):
    model = await TrainableModel("constant").register(server.url)
    groups = await demo_groups(model, 2, 4)
    # every rollout solved, failed, or the same reward in between: the figures say which
    for rewards, split, said in (([[1, 1, 1, 1], [1, 1, 1, 1]], (2, 0), "solved its task"),
                                 ([[0, 0, 0, 0], [0, 0, 0, 0]], (0, 2), "failed its task"),
                                 ([[0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]], (0, 0), "no signal")):
        result = await model.train(with_rewards(groups, rewards))
        assert not result.trained
        assert result.step == 0 and await model.get_step() == 0
        assert result.metrics.groups_dropped_constant == 2
        assert (result.metrics.groups_constant_solved, result.metrics.groups_constant_failed) == split
        assert any("same reward" in w and said in w for w in result.warnings), result.warnings
        assert result.metrics.queue_seconds is not None and result.metrics.queue_seconds >= 0


async def test_every_attempt_is_stored_with_why_it_trained_or_not(server):
    """Rollouts that all failed, groups of one, then a step that trains: three attempts, in order,
    each with the warnings its job returned; only the last one is a step."""

    model = await TrainableModel("attempts").register(server.url)
    failed = [TrajectoryGroup(trajectories=[], exceptions=["APIConnectionError: down"] * 2) for _ in range(2)]
    lost = await model.train(failed)
    groups = with_rewards(await demo_groups(model, 2, 2, seed=9), [[0.0, 1.0], [1.0, 0.0]])
    alone = await model.train([TrajectoryGroup(trajectories=g.trajectories[:1]) for g in groups])
    trained = await model.train(groups, TrainConfig(learning_rate=1e-4))
    attempts = (await model.request("GET", "/ui/api/runs/attempts/attempts"))["data"]
    assert lost.warnings == ["All 4 rollouts failed with errors and were excluded: nothing was left to train on. "
                             "Check the server, tools or judge."]
    assert lost.metrics.groups_dropped_failed == 2 and lost.metrics.groups_dropped_constant == 0
    assert alone.metrics.groups_dropped_single == 2 and not any("same reward" in w for w in alone.warnings)
    assert any("a group of one trajectory cannot train" in w for w in alone.warnings)
    assert [(a["attempt"], a["step"], a["trained"], a["outcome"]) for a in attempts] == [
        (1, 1, False, "untrained"), (2, 1, False, "untrained"), (3, 1, True, "trained")]
    assert [a["warnings"] for a in attempts] == [lost.warnings, alone.warnings, trained.warnings]
    assert [a["job_id"] for a in attempts] == [lost.job_id, alone.job_id, trained.job_id]
    assert attempts[2]["metrics"]["lora_update_norm"] == trained.metrics.lora_update_norm > 0


async def test_a_collapse_is_named_by_the_step_that_suffers_it(server):
    """A step with signal, then one where every rollout fails alike: what a policy broken by its last
    update looks like (seen at lr 3e-3: every tool call malformed). The second step says so."""
    model = await TrainableModel("collapse").register(server.url)
    groups = await demo_groups(model, 2, 4, seed=5)
    first = await model.train(with_rewards(groups, [[0, 1, 0, 1], [1, 0, 0, 0]]), TrainConfig(learning_rate=1e-4))
    assert first.trained and not any("collapse" in w for w in first.warnings)
    broken = await model.train(with_rewards(groups, [[0, 0, 0, 0], [0, 0, 0, 0]]))
    assert not broken.trained
    assert any("Reward fell from 0.375" in w and "collapse" in w for w in broken.warnings), broken.warnings
    solved = await model.train(with_rewards(groups, [[1, 1, 1, 1], [1, 1, 1, 1]]))
    assert not any("collapse" in w for w in solved.warnings)


async def test_a_dropped_group_still_counts_in_the_loss_normaliser(server):
    model = await TrainableModel("share").register(server.url)
    groups = with_rewards(await demo_groups(model, 2, 4, seed=3), [[1, 1, 1, 1], [0, 1, 0, 1]])
    result = await model.train(groups, TrainConfig(learning_rate=1e-3))
    m = result.metrics.model_dump()
    assert result.trained and m["groups_dropped_constant"] == 1
    dropped = sum(len(c.token_ids) for t in groups[0].trajectories for c in t.choices())
    assert m["signal_share"] == pytest.approx(m["trainable_tokens"] / (m["trainable_tokens"] + dropped))
    plain = await model.train(groups, TrainConfig(learning_rate=1e-3, count_dropped_groups=False))
    assert plain.metrics.signal_share == 1.0


async def test_weight_decay_is_applied(server):
    """At step one a LoRA's B is zero, so A gets no gradient: only decoupled weight decay moves it."""
    groups = None
    norms = {}
    for wd in (0.0, 50.0):  # lr * wd = 5%: A shrinks by 5% in one step
        model = await TrainableModel(f"wd-{wd}", lora={"seed": 7}).register(server.url)
        if groups is None:
            groups = with_rewards(await demo_groups(model, 1, 4, seed=4), [[0, 1, 0, 1]])
        result = await model.train(groups, TrainConfig(learning_rate=1e-3, weight_decay=wd))
        norms[wd] = result.metrics.lora_update_norm
    assert norms[50.0] > norms[0.0] * 1.2, norms


async def test_on_policy_multiturn_step_is_token_exact_and_moves_the_lora(server):
    model = await TrainableModel("onpolicy").register(server.url)
    groups = await demo_groups(model, 3, 4, seed=1)
    assert any(len(t.choices()) >= 2 for g in groups for t in g.trajectories), "want multi-turn rollouts"
    assert any(t.metrics.get("tool_calls", 0) >= 1 for g in groups for t in g.trajectories)
    rng = random.Random(0)
    groups = with_rewards(groups, [[rng.random() for _ in range(4)] for _ in groups])
    # Inference keeps running while the step trains.
    sampler = asyncio.create_task(demo_groups(model, 2, 4, seed=2))
    result = await model.train(groups, TrainConfig(learning_rate=1e-3))
    await sampler
    m = result.metrics.model_dump()
    assert result.trained and result.step == 1
    assert m["logprob_gap"] <= 1e-3
    assert m["prompt_mismatches"] == 0 and m["trained_choices"] == m["choices"]
    assert m["lora_update_norm"] > 0
    assert m["groups_trainable"] == 3 and m["trainable_tokens"] > 0
    for name in ("reward_mean", "reward_std", "clip_fraction", "entropy", "grad_norm", "kl_to_base",
                 "truncated_fraction", "loss", "tokens_per_second", "step_seconds", "groups_total",
                 "trajectories_excluded"):
        assert name in m and m[name] is not None and math.isfinite(m[name]), name
    # where the step's time went: every phase measured, and together within the step's own time
    phases = [m[name] for name in ("assembly_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds")]
    assert all(t > 0 for t in phases) and sum(phases) <= m["step_seconds"], m
    assert m["checkpoint_seconds"] > 0 and m["publish_seconds"] > 0
    # the run's name now serves step 1, and step 0 stays addressable
    async with model.openai_client() as client:
        r = await client.chat.completions.create(model="onpolicy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].sampling["step"] == 1
        r0 = await client.chat.completions.create(model="onpolicy@0", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r0.choices[0].sampling["step"] == 0


async def test_exceptions_are_counted_not_scored(server):
    model = await TrainableModel("exceptions").register(server.url)
    groups = await demo_groups(model, 1, 3, seed=3)
    g = with_rewards(groups, [[0.0, 1.0, 0.5]])[0]
    g = TrajectoryGroup(trajectories=g.trajectories, exceptions=["APIConnectionError: server down"])
    result = await model.train([g])
    assert result.metrics.trajectories_excluded == 1
    assert result.metrics.trajectories_total == 3
    assert result.metrics.reward_mean == pytest.approx(0.5)  # the failure is not a zero reward


async def test_resubmitted_idempotency_key_trains_once(server):
    model = await TrainableModel("idempotent").register(server.url)
    groups = with_rewards(await demo_groups(model, 1, 2, seed=4), [[0.0, 1.0]])
    first = await model.train(groups, idempotency_key="step-1")
    again = await model.train(groups, idempotency_key="step-1")
    assert first.step == again.step == 1
    assert first.job_id == again.job_id
    assert await model.get_step() == 1


async def test_sft_lowers_loss_on_its_demonstrations(server):
    model = await TrainableModel("sft", lora={"rank": 16, "alpha": 32}).register(server.url)
    rng = random.Random(0)
    convs = [demo.demonstration(t, False, rng) for t in demo.make_example().train_tasks(5)[:8]]
    first = await model.train_sft(convs)
    second = await model.train_sft(convs)
    assert first.trained and second.step == 2
    assert second.metrics.loss < first.metrics.loss


async def test_an_sft_turn_of_weight_0_is_context_through_the_server_and_a_bad_weight_is_refused(server):
    model = await TrainableModel("sft-weight").register(server.url)
    conv = demo.demonstration(demo.make_example().train_tasks(5)[0], False, random.Random(0))  # a call, then the answer
    first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
    slip = [m | {"weight": 0} if i == first else m for i, m in enumerate(conv)]
    whole, mended = await model.train_sft([conv]), await model.train_sft([slip])
    assert 0 < mended.metrics.trainable_tokens < whole.metrics.trainable_tokens
    body = {"kind": "sft", "conversations": [{"messages": [m | {"weight": 2} if i == first else m
                                                           for i, m in enumerate(conv)]}]}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post("/v1/runs/sft-weight/jobs", json=body)
    assert r.status_code == 400 and "weight is 0 or 1" in r.json()["error"]["message"], r.text
    assert await model.get_step() == 2


async def test_bad_training_input_gets_clear_4xx_and_server_keeps_working(server):
    model = await TrainableModel("badinput").register(server.url)
    good = with_rewards(await demo_groups(model, 1, 2, seed=6), [[0.0, 1.0]])
    body = {"kind": "rl", "groups": [g.model_dump(mode="json") for g in good], "config": {}}

    def variant(fn):
        b = json.loads(json.dumps(body))
        fn(b)
        return b

    def first_choice(b):
        return next(i for i in b["groups"][0]["trajectories"][0]["messages_and_choices"] if "finish_reason" in i)

    cases = {
        "nan reward": (variant(lambda b: b["groups"][0]["trajectories"][0].update(reward=float("nan"))), "finite"),
        "empty group": (variant(lambda b: b["groups"].append({"trajectories": [], "exceptions": []})), "empty"),
        "no groups": (variant(lambda b: b.update(groups=[])), "nothing to train"),
        "bad token id": (variant(lambda b: first_choice(b)["token_ids"].__setitem__(0, 10**7)), "not valid"),
        "other model": (variant(lambda b: first_choice(b)["sampling"].update(model_fingerprint="0" * 16)), "another model"),
        "bad loss": (variant(lambda b: b.update(config={"loss": "sgd"})), "loss"),
        "negative lr": (variant(lambda b: b.update(config={"learning_rate": -1})), "learning_rate"),
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for name, (payload, needle) in cases.items():
            r = await http.post("/v1/runs/badinput/jobs", content=json.dumps(payload, allow_nan=True),
                                headers={"content-type": "application/json"})
            assert r.status_code == 400, (name, r.text)
            assert needle in r.json()["error"]["message"], (name, r.json())
        r = await http.post("/v1/runs/nope/jobs", json=body)
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
        r = await http.post("/v1/runs/badinput/jobs", content=b"{" + b" " * (70 * 1024 * 1024) + b"}",
                            headers={"content-type": "application/json"})
        assert r.status_code == 413
    assert await model.get_step() == 0
    result = await model.train(good)  # and the server still trains
    assert result.trained and result.step == 1


async def test_checkpoints_list_delete_and_prune_keep_latest_and_best(server):
    model = await TrainableModel("ckpt").register(server.url)
    groups = with_rewards(await demo_groups(model, 1, 2, seed=7), [[0.0, 1.0]])
    for _ in range(3):
        await model.train(groups)
    steps = [c["step"] for c in await model.list_checkpoints()]
    assert steps == [0, 1, 2, 3]
    with pytest.raises(ServerError) as e:
        await model.request("DELETE", "/v1/runs/ckpt/checkpoints/3")
    assert e.value.status == 409
    best = max((c for c in await model.list_checkpoints() if c["step"] > 0),
               key=lambda c: c["metrics"]["lora_update_norm"])["step"]
    deleted = await model.delete_checkpoints(best_metric="lora_update_norm", mode="max")
    kept = [c["step"] for c in await model.list_checkpoints()]
    assert 3 in kept and best in kept and set(deleted).isdisjoint(kept)


async def test_runs_on_one_base_coexist(server):
    a = await TrainableModel("coexist-a").register(server.url)
    b = await TrainableModel("coexist-b", lora={"rank": 4, "alpha": 8}).register(server.url)
    groups = with_rewards(await demo_groups(a, 1, 2, seed=8), [[0.0, 1.0]])
    await a.train(groups)
    assert await a.get_step() == 1 and await b.get_step() == 0
    with pytest.raises(ServerError) as e:  # same name, other LoRA settings
        await TrainableModel("coexist-b", lora={"rank": 8}).register(server.url)
    assert e.value.status == 409
