"""The email example against a real art-server on SmolLM2-135M-Instruct (its tools shown by the
Qwen 2.5 template): a rollout through the mailbox's tools, and `client.train --example email`
judged by RULER with the server's own base model as the judge, through its OpenAI API."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI

from examples.email import make_example
from rollouts.agent import rollout
from tests.conftest import ServerProcess
from tests.helpers import train_cli
from tests.real_models import CACHE, TEMPLATES, converted, smollm2_gguf

TOOL_NAMES = {"search_inbox", "read_email", "answer"}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    converted(smollm2_gguf())
    srv = ServerProcess(tmp_path_factory.mktemp("email-smollm2"), model=smollm2_gguf(),
                        extra=["--cache-dir", str(CACHE), "--served-model-name", "smollm2",
                               "--chat-template", str(TEMPLATES / "qwen2_5.jinja")]).start(timeout=600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("email-cache")


async def test_a_rollout_goes_through_the_mailbox_tools(smollm2, cache):
    example = make_example(cache=cache)
    example.settings.max_turns, example.settings.max_tokens, example.settings.seed = 3, 96, 11
    task = example.eval_tasks()[0]

    async with AsyncOpenAI(base_url=smollm2.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        traj = await rollout(client, "smollm2", example.make_env(task), task, example.settings)
    choices = traj.choices()
    calls = [c for choice in choices for c in choice.message.tool_calls or []]
    # tool_choice "required" with one call per turn: every turn that fit max_tokens is one email tool call
    assert calls and {c.function.name for c in calls} <= TOOL_NAMES
    assert all(len(choice.message.tool_calls or []) <= 1 for choice in choices)
    results = {m["tool_call_id"]: m["content"] for m in traj.messages() if m.get("role") == "tool"}
    assert set(results) == {c.id for c in calls}  # each call answered, errors included, as the model sees them
    for call in calls:
        if call.function.name == "search_inbox" and not results[call.id].startswith("Error"):
            hits = json.loads(results[call.id]) if results[call.id].startswith("[") else []
            assert all(h["message_id"].startswith("m") for h in hits)
    assert traj.metrics["tool_calls"] == len(calls)
    assert traj.metrics["searches"] + traj.metrics["reads"] + traj.metrics["tool_errors"] + \
        traj.metrics["answered_with_tool"] >= 1
    assert traj.metadata["stop_reason"] in {"answered", "max_turns", "max_tokens"}
    assert traj.reward in (0.0, 1.0) and traj.reward == float(traj.metrics["exact_match"])
    # the turns are training data: the server's token ids came back with every choice
    assert all(choice.token_ids and choice.logprobs.content for choice in choices)


def test_train_cli_email_with_the_base_model_as_ruler_judge(smollm2, cache, tmp_path):
    # The least that shows it: one step of two groups of two (a group the judge scores evenly is
    # dropped, so two, and up to three attempts), held-out reward on one question before and after;
    # about 2.5 minutes on an idle 2-core CPU, 5 under load.
    # Seeded: unseeded, a judge that scored both groups of each of three attempts evenly stopped the
    # run untrained now and then (seen under the full suite's load).
    proc = train_cli(smollm2.url, tmp_path, "email-1", "--example", "email", "--steps", "1", "--groups-per-step", "2",
                     "--group-size", "2", "--eval-tasks", "1", "--eval-every", "0", "--max-turns", "2",
                     "--max-tokens", "48", "--patience", "3", "--seed", "0", timeout=900,
                     env={"ARTISAN_EMAIL_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [0, 1]
    assert 0.0 <= summary["eval_reward_before"] <= 1.0 and 0.0 <= summary["eval_reward_after"] <= 1.0
    # A judge may score both groups evenly (nothing to train): up to three attempts make the step.
    history = summary["history"]
    step = history[-1]
    assert step["trained"] and step["prompt_mismatches"] == 0
    judge = summary["judge"]
    # every attempt's two training groups went to the judge (art-server's base model), judged or
    # failed (or had nothing to compare), and each malformed reply it gave was counted, in each
    # attempt and in the run's total
    for attempt in history:
        j = attempt["judge"]
        assert j["judged"] + j["failed"] + j["skipped"] == 2 and j["attempts"] >= 2
    assert judge == {k: sum(a["judge"][k] for a in history) for k in judge}
    assert 0 <= judge["malformed"] <= judge["attempts"]
    assert "judge: " in proc.stdout
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["judge"] == judge and "eval_reward_before" in last and "eval_reward_after" in last
