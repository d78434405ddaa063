"""verifiers environments against a live art-server on SmolLM2-135M-Instruct.

Runs in its own environment with verifiers 0.4 and reasoning-gym (`make test-verifiers`); the
server runs from the main one. Episodes run as verifiers runs them: its `null` chat harness in a
local subprocess (a PEP 723 program verifiers prepares with `uv`), its interception server, its
eval client, pointed at art-server directly (`vf-eval`) or through the adapter's relay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

vf = pytest.importorskip("verifiers.v1")

from client import TrainConfig, TrainableModel  # noqa: E402
from client.gather import TooManyExceptions  # noqa: E402
from client.local_server import ROOT, LocalServer, free_port  # noqa: E402
from client.adapters.verifiers import gather_verifiers_groups  # noqa: E402
from protocol.choices import choice_sampling, choice_token_ids  # noqa: E402

SERVER_PYTHON = str(ROOT / ".venv" / "bin" / "python")
HOOKS = Path(__file__).with_name("hooks.py")
MAX_TOKENS = 16
# verifiers runs its chat program through `uv`, looked up on PATH: this environment's own.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault("UV_NATIVE_TLS", "1")  # the first run fetches the program's packages from PyPI


def _in_server_env(code: str) -> str:
    return subprocess.run([SERVER_PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _smollm2() -> str:
    """The GGUF file lives in the server's environment, with the rest of the test models."""
    return _in_server_env("from tests.real_models import smollm2_gguf; print(smollm2_gguf())")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServer(tmp_path_factory.mktemp("art-server"), model=_smollm2(), python=SERVER_PYTHON,
                      extra=["--device", "cpu", "--cache-dir", str(ROOT / "test-artifacts" / "cache"),
                             "--served-model-name", "smollm2"]).start(timeout=600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smollm2_dir(server) -> str:
    """The model directory the server serves SmolLM2 from: its tokenizer and chat template are
    what verifiers' train client renders prompts with."""
    return _in_server_env("from tests.real_models import converted, smollm2_gguf; print(converted(smollm2_gguf()))")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def reasoning_gym_env(**rewards) -> vf.Env:
    """chain_sum with verifiers' null harness in a subprocess; `rewards` plugs extra rubric entries."""
    return vf.load_environment(vf.SingleAgentEnvConfig.model_validate({
        "taskset": {"id": "reasoning-gym-env", "dataset": "chain_sum", "size": 8, "seed": 1,
                    "options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                    "task": {"rewards": rewards}},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    }))


async def test_adapter_groups_train_one_step_token_exactly(server, in_tmp):
    # A length bonus beside reasoning-gym's own score, so that groups differ even if no reply is right.
    env = reasoning_gym_env(length={"fn": f"{HOOKS}:reply_chars", "weight": 0.001})

    model = await TrainableModel("vf-adapter").register(server.url)
    tasks = list(env.taskset)[:3]
    groups = await gather_verifiers_groups(env, model, tasks, group_size=4,
                                           sampling={"temperature": 1.0, "max_tokens": MAX_TOKENS})
    assert len(groups) == 3
    for group, task in zip(groups, tasks):
        assert group.exceptions == [] and len(group.trajectories) == 4
        assert group.metadata["task"] == task.key
        for t in group.trajectories:
            [c] = t.choices()
            assert 0 < len(choice_token_ids(c)) <= MAX_TOKENS
            assert len(c.logprobs.content) == len(choice_token_ids(c))
            assert choice_sampling(c).policy == "vf-adapter" and choice_sampling(c).temperature == 1.0
            assert t.messages_and_choices[1] == {"role": "user", "content": task.data.prompt}
            # the rubric's reward, component by component
            assert t.reward == pytest.approx(t.metrics["reward_correct"] + 0.001 * t.metrics["reward_length"])
            assert t.metrics["reward_length"] == len((c.message.content or "").strip())  # last_reply strips
    result = await model.train(groups, TrainConfig(learning_rate=1e-4))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.trajectories_total == 12 and m.trained_choices == m.choices == 12
    assert m.prompt_mismatches == 0 and m.recovered_choices == 0
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3
    assert m.lora_update_norm > 0


async def test_adapter_groups_from_the_train_client_train_one_step_token_exactly(server, smollm2_dir, in_tmp):
    """verifiers renders the prompts (SmolLM2's own template, as art-server does) and samples them
    on art-server's token-in route through the relay: the groups train with no prompt mismatch."""
    env = reasoning_gym_env(length={"fn": f"{HOOKS}:reply_chars", "weight": 0.001})

    model = await TrainableModel("vf-token-in").register(server.url)
    tasks = list(env.taskset)[:2]
    groups = await gather_verifiers_groups(env, model, tasks, group_size=4, renderer_model=smollm2_dir,
                                           sampling={"temperature": 1.0, "max_tokens": MAX_TOKENS})
    for group, task in zip(groups, tasks):
        assert group.exceptions == [] and len(group.trajectories) == 4
        for t in group.trajectories:
            [c] = t.choices()
            assert 0 < len(choice_token_ids(c)) <= MAX_TOKENS
            assert len(c.logprobs.content) == len(choice_token_ids(c))
            assert choice_sampling(c).policy == "vf-token-in" and choice_sampling(c).temperature == 1.0
            assert t.messages_and_choices[-2] == {"role": "user", "content": task.data.prompt}
            assert t.metrics["reward_length"] == len((c.message.content or "").strip())
    result = await model.train(groups, TrainConfig(learning_rate=1e-4))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.trained_choices == m.choices == 8
    assert m.prompt_mismatches == 0 and m.recovered_choices == 0
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3


async def test_a_rollout_whose_model_is_unreachable_is_an_exception_not_a_zero(server, in_tmp):
    env = reasoning_gym_env()

    model = await TrainableModel("vf-down").register(server.url)
    model.server_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tasks = list(env.taskset)[:1]
    [group] = await gather_verifiers_groups(env, model, tasks, group_size=2, max_exceptions=1.0,
                                            sampling={"max_tokens": MAX_TOKENS})
    assert group.trajectories == [] and len(group.exceptions) == 2
    assert all("art-server" in e or "Provider" in e for e in group.exceptions), group.exceptions
    with pytest.raises(TooManyExceptions, match="2 of 2 verifiers rollouts failed"):
        await gather_verifiers_groups(env, model, tasks, group_size=2, sampling={"max_tokens": MAX_TOKENS})


def test_vf_eval_runs_the_environment_against_art_server(server, in_tmp):
    out = Path.cwd() / "outputs"
    cmd = [str(Path(sys.executable).parent / "vf-eval"), "reasoning-gym-env",
           "--env.taskset.dataset", "chain_sum", "--env.taskset.size", "4",
           "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess",
           "--client.base-url", server.url + "/v1", "--model", "smollm2",
           "--sampling.max-tokens", str(MAX_TOKENS), "--sampling.temperature", "0.7",
           "-n", "2", "-r", "2", "--no-push", "--no-rich", "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [traces] = list(out.glob("*/traces.jsonl"))
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(episodes) == 4 and all(e["ok"] for e in episodes)
    for e in episodes:
        [trace] = e["traces"]
        assert 0.0 <= trace["rewards"]["correct"]["score"] <= 1.0
        assert trace["calls"][0]["model"] == "smollm2" and trace["calls"][0]["usage"]["completion_tokens"] > 0
    assert "reward=" in proc.stderr  # verifiers' own per-rollout report


def test_vf_eval_with_the_train_client_samples_token_in_from_art_server(server, smollm2_dir, in_tmp):
    """verifiers renders each prompt itself (SmolLM2's template, from the server's own model
    directory) and calls art-server's /inference/v1/generate with the ids."""
    out = Path.cwd() / "outputs"
    cmd = [str(Path(sys.executable).parent / "vf-eval"), "reasoning-gym-env",
           "--env.taskset.dataset", "chain_sum", "--env.taskset.size", "4",
           "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess",
           "--client.type", "train", "--client.base-url", server.url + "/v1",
           "--client.renderer-model-name", smollm2_dir, "--model", "smollm2",
           "--sampling.max-tokens", str(MAX_TOKENS), "--sampling.temperature", "0.7",
           "-n", "2", "-r", "2", "--no-push", "--no-rich", "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [traces] = list(out.glob("*/traces.jsonl"))
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(episodes) == 4 and all(e["ok"] for e in episodes), [e.get("errors") for e in episodes]
    for e in episodes:
        [trace] = e["traces"]
        assert 0.0 <= trace["rewards"]["correct"]["score"] <= 1.0
        [call] = trace["calls"]
        assert call["model"] == "smollm2" and call["usage"]["completion_tokens"] > 0
        # Token ids and logprobs reach verifiers only from a token-in route.
        answer = trace["nodes"][call["node"]]
        sampled = [t for t, m in zip(answer["token_ids"], answer["mask"]) if m]
        assert 0 < len(sampled) <= MAX_TOKENS and len(answer["logprobs"]) == len(sampled)
        # verifiers' rendering of the prompt is art-server's own, token for token.
        path = [n for n in trace["nodes"] if n is not answer]
        prompt = [t for n in path for t in n["token_ids"]] + answer["token_ids"][:len(answer["token_ids"]) - len(sampled)]
        messages = [{"role": n["message"]["role"], "content": n["message"]["content"]} for n in path]
        assert _served_prompt(server.url, messages) == prompt
    assert "reward=" in proc.stderr


def _served_prompt(url: str, messages: list[dict]) -> list[int]:
    """The ids art-server renders `messages` to, as its chat route reports them."""
    resp = httpx.post(url + "/v1/chat/completions", json={"model": "smollm2", "messages": messages, "max_tokens": 1},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["prompt_token_ids"]
