"""Code written for OpenPipe ART, unchanged but for its backend, against a live art-server.

Runs in its own environment with the real `openpipe-art` package (`make test-art`); the server runs
from the main one. The model is SmolLM2-135M-Instruct: ART's yes/no/maybe task needs a model that
sometimes answers yes, no or maybe (the embedded shop agent never does).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import subprocess
import sys
import types

import httpx
import pydantic
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

art = pytest.importorskip("art")
import litellm  # noqa: E402
from art.rewards import ruler_score_group  # noqa: E402
from art.utils import iterate_dataset  # noqa: E402
from art.utils.litellm import convert_litellm_choice_to_openai  # noqa: E402
from openai.types.chat.chat_completion import Choice  # noqa: E402
from openai.types.chat.chat_completion_message import ChatCompletionMessage  # noqa: E402

from client import TrainableModel as ArtisanModel  # noqa: E402
from client.adapters.art_compat import ArtisanBackend, UnsupportedArgument  # noqa: E402
from client.local_server import ROOT, LocalServer  # noqa: E402
from rewards.ruler import JudgeConfig, score_group  # noqa: E402

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SERVER_PYTHON = str(ROOT / ".venv" / "bin" / "python")


def yes_no_maybe():
    """ART's own example, from the installed package. Its module imports ART's Tinker backend,
    which needs torch; only the name is stubbed, so the rollout runs from the installed file."""
    if "art.tinker_native" not in sys.modules:
        stub = types.ModuleType("art.tinker_native")
        stub.TinkerNativeBackend = object
        sys.modules["art.tinker_native"] = stub
    from art.pipeline_trainer import yes_no_maybe_pipeline

    return yes_no_maybe_pipeline


def trainable(name: str, **kw) -> "art.TrainableModel":
    """openpipe-art 0.5.20 made `run_name` (one model, several runs of it) a required argument."""
    runs = {"run_name": name} if "run_name" in art.TrainableModel.model_fields else {}
    return art.TrainableModel(name=name, **runs, **kw)


def _smollm2() -> str:
    """The GGUF file lives in the server's environment, with the rest of the test models."""
    # tests.real_models by path: ART's dependency `cint` installs a top-level `tests` package of its own.
    code = "import sys; sys.path.insert(0, 'tests'); from real_models import smollm2_gguf; print(smollm2_gguf())"
    return subprocess.run([SERVER_PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServer(tmp_path_factory.mktemp("art-server"), model=_smollm2(), python=SERVER_PYTHON,
                      extra=["--device", "cpu", "--cache-dir", str(ROOT / "test-artifacts" / "cache"), "--served-model-name", "smollm2",
                             "--served-model-name", HUB_ID]).start(timeout=600)
    yield srv
    srv.stop()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ART writes its logs under ./.art


async def test_arts_own_loop_trains_three_steps(server, in_tmp):
    ynm = yes_no_maybe()

    backend = ArtisanBackend(server.url)
    model = trainable("ynm", project="artisan-art", base_model=HUB_ID)
    await model.register(backend)
    steps = []
    for batch in iterate_dataset(ynm.build_scenarios(), groups_per_step=4, num_epochs=1, use_tqdm=False):
        groups = await art.gather_trajectory_groups(
            (ynm.rollout_fn(model, scenario, None) for scenario in batch.items), pbar_desc="ynm")
        result = await backend.train(model, groups, learning_rate=1e-4)
        await model.log(groups, split="train", metrics=result.metrics, step=result.step)
        steps.append(result)
        if len(steps) == 3:
            break
    assert [r.step for r in steps] == [1, 2, 3] and await model.get_step() == 3
    for r in steps:
        assert r.metrics["prompt_mismatches"] == 0 and r.metrics["logprob_gap"] <= 1e-3
    val = await art.gather_trajectory_groups(
        [ynm.rollout_fn(model, {"prompt": "respond with maybe"}, None)], pbar_desc="val")
    await model.log(val, split="val")
    assert os.path.exists(f".art/artisan-art/models/ynm/trajectories/val/{3:04d}.parquet")

    await model.delete_checkpoints(best_checkpoint_metric="train/reward")
    kept = [c["step"] for c in await backend._run(model).list_checkpoints()]
    assert 3 in kept and len(kept) <= 2, kept

    sft = [art.Trajectory(messages_and_choices=[{"role": "user", "content": s["prompt"]},
                                                {"role": "assistant", "content": "maybe"}], reward=1.0)
           for s in ynm.build_scenarios()[:8]]
    await model.train_sft(sft, art.TrainSFTConfig(learning_rate=1e-4, batch_size=4))
    assert await model.get_step() == 4
    await backend.close()


async def test_litellm_and_streamed_rollouts_train_token_exactly(server, in_tmp):
    backend = ArtisanBackend(server.url)
    model = trainable("rebuilt", project="artisan-art", base_model=HUB_ID)
    await model.register(backend)
    client = model.openai_client()
    groups = []
    for g, prompt in enumerate(["respond with yes or no", "just respond with maybe or no"]):
        trajs = []
        for seed in range(4):
            messages = [{"role": "user", "content": prompt}]
            if seed % 2:  # litellm, as ART's examples call it, and ART's own conversion of its choice
                resp = await litellm.acompletion(model=f"hosted_vllm/{model.get_inference_name()}",
                                                 messages=messages, api_base=server.url + "/v1", api_key="x",
                                                 max_tokens=6, seed=g * 10 + seed)
                choice = convert_litellm_choice_to_openai(resp.choices[0])
            else:  # streamed, the choice rebuilt from its chunks
                stream = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                              max_tokens=6, seed=g * 10 + seed, stream=True)
                text, finish = "", None
                async for chunk in stream:
                    for c in chunk.choices:
                        text, finish = text + (c.delta.content or ""), c.finish_reason or finish
                choice = Choice(index=0, finish_reason=finish,
                                message=ChatCompletionMessage(role="assistant", content=text))
            trajs.append(art.Trajectory(messages_and_choices=[*messages, choice], reward=float(seed)))
        groups.append(art.TrajectoryGroup(trajs))
    result = await backend.train(model, groups, learning_rate=1e-4, loss_fn="ppo")
    assert result.step == 1
    m = result.metrics
    assert m["recovered_choices"] == m["choices"] == m["trained_choices"] == 8
    assert m["prompt_mismatches"] == 0 and m["logprob_gap"] <= 1e-3
    with pytest.raises(UnsupportedArgument, match="advantage_balance"):
        await backend.train(model, groups, advantage_balance=0.5)


async def test_ruler_with_art_server_as_the_judge(server, in_tmp):
    judge = {"api_base": server.url + "/v1", "api_key": "x", "temperature": 0, "max_tokens": 600}
    group = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "What is 2+2?"},
                                             {"role": "assistant", "content": answer}], reward=0.0)
        for answer in ("4", "5")])

    # ART parses the judge's reply with its own pydantic schema (no bounds on the score) and
    # raises when it does not validate; the 135M judge's numbers need not be sensible.
    try:
        scored = await ruler_score_group(group, judge_model="openai/smollm2", extra_litellm_params=judge)
    except pydantic.ValidationError as e:
        # ART 0.5.23 asks for its JSON schema (response_format), which art-server decodes under
        # constraint; the schema does not bound the explanation string, and the 135M judge never
        # closes it, so the reply ends at max_tokens. What the server owes: a prefix of that schema.
        cut = e.errors()[0]["input"]
        assert cut.startswith('{"scores": [{"trajectory_id": "'), cut[:80]
    else:
        assert scored is not None
        assert all(math.isfinite(t.reward) and t.metrics["ruler_score"] == t.reward for t in scored.trajectories)
    ours = await score_group(group_as_ours(group), JudgeConfig(model="smollm2", base_url=server.url + "/v1",
                                                               temperature=0, max_tokens=600), max_retries=2,
                             backoff_s=0.0)
    assert all(0 <= t.metrics["ruler_score"] <= 1 for t in ours.trajectories)


def group_as_ours(group):
    from client.adapters.art_compat import _groups

    return _groups([group])[0]


async def test_a_step_with_nothing_to_train_raises_instead_of_spinning(server, in_tmp):
    backend = ArtisanBackend(server.url)
    model = trainable("flat", project="artisan-art", base_model=HUB_ID)
    await model.register(backend)
    resp = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=4)
    flat = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, c],
                                               reward=0.5) for c in resp.choices])
    with pytest.raises(Exception, match="same reward"):
        await backend.train(model, [flat])
    assert await model.get_step() == 0
    assert await ArtisanModel("flat").register(server.url) is not None  # the run is there, at step 0


async def test_a_model_that_is_not_trainable_makes_no_run(server, in_tmp):
    judge = art.Model(name="judge", project="artisan-art", inference_model_name="gpt-4.1",
                      inference_base_url="http://127.0.0.1:9/v1", inference_api_key="x")
    await judge.register(ArtisanBackend(server.url))
    runs = httpx.get(server.url + "/v1/runs", timeout=30).json()["data"]
    assert "judge" not in {r["name"] for r in runs}


def test_arts_train_keywords_keep_arts_meaning():
    from client.adapters.art_compat import train_config

    cispo = train_config()
    assert (cispo.loss, cispo.epsilon_low, cispo.epsilon_high, cispo.scale_rewards) == ("cispo", 1.0, 4.0, True)
    assert cispo.learning_rate is None  # the server's default for its model, not ART's 5e-6
    ppo = train_config(loss_fn="ppo", learning_rate=3e-5, normalize_advantages=False)
    assert (ppo.loss, ppo.epsilon_low, ppo.epsilon_high, ppo.scale_rewards, ppo.learning_rate) == (
        "ppo", 0.2, 0.2, False, 3e-5)
    assert train_config(loss_fn="ppo", epsilon=0.1, epsilon_high=0.3).epsilon_high == 0.3
    assert train_config(verbose=True, kl_penalty_coef=0.0).loss == "cispo"  # defaults and execution knobs pass
    for bad in ({"kl_penalty_coef": 0.1}, {"importance_sampling_level": "sequence"}, {"loss_fn": "dpo"},
                {"no_such_argument": 1}):
        with pytest.raises(UnsupportedArgument, match=next(iter(bad))):
            train_config(**bad)


async def test_arts_pipeline_trainer_trains_four_steps_through_this_backend(server, in_tmp):
    """ART's asynchronous PipelineTrainer with ART's own yes/no/maybe rollout and eval functions:
    rollouts go on while steps train, each group sampled by the step its adapter lease pinned."""
    ynm = yes_no_maybe()
    import art.pipeline_trainer as pipeline_trainer

    ynm.ROLLOUTS_PER_SCENARIO = 8  # ART's example samples 32 per group, for a GPU box
    pruned: list[set[int]] = []

    class Backend(ArtisanBackend):
        async def prune_model_adapters(self, model, *, retain_steps):
            pruned.append(set(retain_steps))
            await super().prune_model_adapters(model, retain_steps=retain_steps)

    settings = {"num_rollout_workers": 4, "min_batch_size": 2, "max_batch_size": 4}
    runtime = getattr(pipeline_trainer, "PipelineRuntimeConfig", None)  # 0.5.20 moved these into one config
    pipeline = {"pipeline": runtime(**settings)} if runtime is not None else settings

    backend = Backend(server.url)
    model = trainable("pipelined", project="artisan-art", base_model=HUB_ID)
    await model.register(backend)
    scenarios = ynm.build_scenarios()
    trainer = pipeline_trainer.PipelineTrainer(
        model=model, backend=backend, rollout_fn=ynm.rollout_fn, scenarios=itertools.cycle(scenarios),
        config=None, learning_rate=1e-4, loss_fn="cispo", max_steps=4, max_steps_off_policy=1,
        eval_fn=functools.partial(ynm.eval_fn, scenarios=scenarios[:4]), eval_every_n_steps=2,
        eval_at_start=False, **pipeline)
    await trainer.train(handle_signals=False)
    step = await model.get_step()
    run = await backend._run(model).request("GET", "/v1/runs/pipelined")
    rows = (await backend._run(model).request("GET", "/v1/runs/pipelined/trajectories",
                                              params={"split": "train"}))["data"]
    await backend.close()
    steps = run["steps"]
    assert step == 4 and [s["step"] for s in steps if s["kind"] == "rl"] == [1, 2, 3, 4]
    for s in steps:
        m = s["metrics"]
        assert m["trained"] and m["staleness_max"] <= 1 and m["prompt_mismatches"] == 0
    assert pruned and all(pruned)  # ART asked the server to unload the steps it no longer samples from
    policies = {c["sampling"]["policy"] for r in rows for c in r["data"]["messages_and_choices"] if "sampling" in c}
    assert policies and all(p.startswith("pipelined@") for p in policies)  # each rollout pinned to its step
