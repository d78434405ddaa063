"""`client.train --warm-start N`: art-server's SFT job on the example's demonstrations is a new
run's first step, evaluated, and GRPO goes on from it; a resumed run is past it."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from client.loop.examples import example_options, load_example
from examples.leg_lookup import TASK, LegLookupEnv, LegLookupExample, calculate, demonstration, legs, rows
from rollouts.env import ToolError
from server.runs.checkpoints import read_optimizer
from tests.helpers import train_cli


def _train(srv, out, run: str, *args: str) -> subprocess.CompletedProcess:
    return train_cli(srv.url, out, run, "--eval-every", "0", "--eval-tasks", "8", "--groups-per-step", "2",
                     "--group-size", "4", "--seed", "0", *args)


def _adam_steps(srv, run: str, step: int) -> set[float]:
    """The update counts in a checkpoint's optimizer state, over its parameters."""
    state = read_optimizer(srv.data_dir / "runs" / run / "checkpoints", step)["state"]
    return {float(s["step"]) for s in state.values()}


def test_a_warm_start_is_the_runs_first_step_and_grpo_goes_on_from_it(server, tmp_path):
    out = tmp_path / "out"
    proc = _train(server, out, "warm-1", "--example", "demo", "--warm-start", "32", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    warm = next(i for i, line in enumerate(lines) if line.startswith("warm start:"))
    assert lines[warm].startswith("warm start: step 1 | SFT on 32 demonstrations x 1 epoch | loss ")
    # evaluated before (the base) and right after (the start GRPO's gain counts from)
    assert lines[warm - 2].startswith("eval @ step 0:") and lines[warm + 1].startswith("eval @ step 1:")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warm_start"]["step"] == 1 and summary["warm_start"]["demonstrations"] == 32
    assert summary["warm_start"]["loss"] > 0
    assert summary["warm_start"]["grad_norm"] > 0 and summary["warm_start"]["lora_update_norm"] > 0
    assert [e["step"] for e in summary["evals"]] == [0, 1, 2]
    assert [h["step"] for h in summary["history"] if h["trained"]] == [2]
    assert httpx.get(f"{server.url}/v1/runs/warm-1", timeout=30).json()["step"] == 2
    # GRPO starts Adam afresh: the SFT step's moments (two optimizer steps of 16) are not its own
    assert [h["optimizer_reset"] for h in summary["history"] if h["trained"]] == [True]
    assert _adam_steps(server, "warm-1", 1) == {2.0} and _adam_steps(server, "warm-1", 2) == {1.0}

    again = _train(server, out, "warm-1", "--example", "demo", "--warm-start", "32", "--steps", "3")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "warm start:" not in again.stdout  # resumed at step 2: the warm start is behind it
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["warm_start"] == summary["warm_start"]
    assert [h["optimizer_reset"] for h in resumed["history"] if h["step"] == 3 and h["trained"]] == [False]
    assert _adam_steps(server, "warm-1", 3) == {2.0}  # RL after RL: the moments go on


def test_an_example_without_demonstrations_is_refused_in_one_line(server, tmp_path):
    proc = _train(server, tmp_path / "out", "warm-none", "--example", "reasoning_gym", "--warm-start", "4")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = proc.stderr.strip()
    assert message == ("error: --warm-start: example 'reasoning-gym-leg_counting' has no demonstrations to train on (an "
                       "Example's demonstrations(n) makes them)")
    assert "Traceback" not in proc.stderr


@pytest.mark.unit
def test_the_calculator_is_arithmetic_and_nothing_else():
    assert calculate("42 * 25") == "1050" and calculate("(3 + 4) * -2") == "-14" and calculate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 8", "1 / 0", "abc", "9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9"):
        with pytest.raises(ToolError):
            calculate(bad)


@pytest.mark.unit
def test_the_leg_table_is_reasoning_gyms_by_name_or_plural():
    assert legs("woodlouses") == legs("Woodlouse") == "14" and legs("sea slug") == "0"
    with pytest.raises(ToolError):
        legs("unicorn")


@pytest.mark.unit
async def test_a_demonstration_is_an_episode_the_environment_scores_1():
    row = rows(TASK, 1, 3)[0]  # several animals: the environment's own task
    demo = demonstration(row)
    env = LegLookupEnv(row)
    for message in demo.messages:
        for call in message.get("tool_calls") or []:
            await env.call_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert demo.messages[-2]["content"] == demo.messages[-1]["content"] == str(row["answer"])
    score = await env.score(demo.messages)
    assert score.reward == 1.0 and score.metrics == {"animals_looked_up": 1.0, "calculated": True, "answered": True}
    # an answer without the tools still scores on its own, and says what was not looked up
    guess = await LegLookupEnv(row).score([*demo.messages[:2], {"role": "assistant", "content": "12"}])
    assert guess.metrics["animals_looked_up"] == 0.0 and guess.metrics["calculated"] is False
    # the warm start's demonstrations: a split of fewer kinds of animal than the held-out questions
    # (the start must not already solve them), none of them a held-out question
    demos = LegLookupExample().demonstrations(256)
    assert len(demos) == 256 and {len(d.messages[2]["tool_calls"]) for d in demos} == {2, 3}
    held_out = [t.data["row"] for t in LegLookupExample().eval_tasks()]
    assert {len(r["metadata"]["animals"]) for r in held_out} == {3, 4}
    assert not {r["question"] for r in held_out} & {d.messages[1]["content"] for d in demos}
    # --demonstration-kinds 4, read as client.train reads the command line, reaches four terms; 5 is refused
    wider = load_example("leg_lookup", **example_options(["--demonstration-kinds", "4"])).demonstrations(256)
    assert {len(d.messages[2]["tool_calls"]) for d in wider} == {2, 3, 4}
    assert not {r["question"] for r in held_out} & {d.messages[1]["content"] for d in wider}
    with pytest.raises(ValueError, match="--demonstration-kinds must be 2 to 4"):
        LegLookupExample(demonstration_kinds=5)

