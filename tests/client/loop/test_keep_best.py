"""--keep-best, against a real server on the embedded model: the run's bare name serves a pinned
earlier step (`PUT /v1/runs/{name}/serving`), exactly as `name@N` does, across a restart, until the
run trains its next step; and `client.train --keep-best` pins the best evaluated step of a run whose
held-out reward fell, saying so on the evaluation line that saw the fall. The loop's other warnings
(training reward falling, no gain, one answer to most held-out tasks) run on the same scripted runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from client import TrainConfig, TrainableModel
from client.loop.training_loop import train_loop
from client.loop.config import LoopConfig
from rollouts.env import Environment, Example, RolloutSettings, Score, Task, ToolError
from server.runs.pins import PIN_FILE
from tests.helpers import demo_groups, with_rewards

CONFIG = TrainConfig(learning_rate=1e-3)
PROMPT = [{"role": "user", "content": "What is the price of apple?"}]
CHROMIUM = Path("/usr/bin/chromium")


async def _step(model: TrainableModel, seed: int) -> int:
    groups = with_rewards(await demo_groups(model, 2, 2, seed=seed), [[0.0, 1.0], [1.0, 0.0]])
    result = await model.train(groups, CONFIG)
    assert result.trained
    return result.step


async def _greedy(model: TrainableModel, name: str) -> tuple[int, list[int], list[float]]:
    """The step `name` decoded with, and its greedy tokens and their logprobs."""
    async with model.openai_client() as client:
        r = await client.chat.completions.create(model=name, messages=PROMPT, max_tokens=6, temperature=0,
                                                 logprobs=True)
    choice = r.choices[0]
    return choice.sampling["step"], choice.token_ids, [t.logprob for t in choice.logprobs.content]


async def _put(url: str, run: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.put(f"/v1/runs/{run}/serving", json=body, headers=headers or {})


def _run_page(url: str, run: str) -> tuple[str, str]:
    """The run page's serving line and best held-out line, as Chromium shows them."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM),
                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/ui/#/run/{run}")
        page.wait_for_function("() => document.body.dataset.ready === 'run'")
        texts = page.locator("#main section > p.muted").first.inner_text(), page.locator("#best-held-out").inner_text()
        browser.close()
    assert errors == [], errors
    return texts


async def test_the_pinned_step_is_served_under_the_runs_name_across_a_restart_until_the_next_step(fresh_server, tmp_path):
    data = tmp_path / "data"
    srv = fresh_server(data_dir=data)

    model = await TrainableModel("pin").register(srv.url)
    assert [await _step(model, 40), await _step(model, 41)] == [1, 2]
    info = await model.request("GET", "/v1/runs/pin")
    assert (info["serving_step"], info["serving_pinned"]) == (2, False)
    # held-out rewards logged per step, as client.train does: step 1 is the best
    for step, rewards in ((0, [0.0, 1.0]), (1, [1.0, 1.0]), (2, [0.0, 0.0])):
        logged = with_rewards(await demo_groups(model, 1, 2, seed=50 + step), [rewards])
        await model.log(logged, split="val", step=step)
    at = {name: await _greedy(model, name) for name in ("pin@1", "pin@2")}
    assert at["pin@1"][2] != at["pin@2"][2]  # two steps apart: the comparison below can fail

    r = await _put(srv.url, "pin", {"step": 1})
    assert r.status_code == 200, r.text
    assert r.json() == {"run": "pin", "serving_step": 1, "latest_step": 2, "pinned": True}
    assert await _greedy(model, "pin") == at["pin@1"]  # the bare name decodes with step 1's adapter
    assert await _greedy(model, "pin@2") == at["pin@2"]  # and every step keeps its own name
    info = await model.request("GET", "/v1/runs/pin")
    assert (info["step"], info["serving_step"], info["serving_pinned"]) == (2, 1, True)
    ui = await model.request("GET", "/ui/api/runs/pin")
    assert ui["serving_step"] == 1 and ui["best_held_out"] == {"step": 1, "reward": 1.0, "n": 2}

    # a step that never was, a missing body, a pinned checkpoint's deletion: clear refusals
    missing = await _put(srv.url, "pin", {"step": 9})
    assert missing.status_code == 404 and "has no step 9 (its latest is step 2)" in missing.text
    nothing = await _put(srv.url, "pin", {})
    assert nothing.status_code == 400 and "step" in nothing.text
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
        kept = await http.delete("/v1/runs/pin/checkpoints/1")
    assert kept.status_code == 409 and "step 1 is what run pin serves" in kept.text
    with ThreadPoolExecutor(1) as pool:  # playwright's sync API runs an event loop of its own: not in this thread
        serving, best = pool.submit(_run_page, srv.url, "pin").result()
    assert serving == "project default · serving step 1 (pinned; latest step 2, served as pin@2)"
    assert best == "best held-out step: 1 (reward 1, 2 tasks)"

    srv.stop()
    srv = fresh_server(data_dir=data)  # the same data directory: the pin is the run's, on disk

    model = await TrainableModel("pin").register(srv.url)
    info = await model.request("GET", "/v1/runs/pin")
    assert (info["step"], info["serving_step"], info["serving_pinned"]) == (2, 1, True)
    assert await _greedy(model, "pin") == at["pin@1"]

    # another client's lease refuses a pin, as it refuses a job
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
        assert (await http.put("/v1/runs/pin/lease", json={"lease_id": "a" * 16})).status_code == 200
        taken = await _put(srv.url, "pin", {"step": 0})
        assert taken.status_code == 409 and "run_trained_by_another_client" in taken.text
        assert (await http.delete(f"/v1/runs/pin/lease/{'a' * 16}")).status_code == 200

    # the next trained step (from the latest weights) is what the name serves again
    assert await _step(model, 42) == 3
    info = await model.request("GET", "/v1/runs/pin")
    assert (info["serving_step"], info["serving_pinned"]) == (3, False)
    assert (await _greedy(model, "pin"))[0] == 3
    assert not (data / "runs" / "pin" / PIN_FILE).exists()

    # a trained step whose checkpoint was deleted is a 409; null serves the latest again
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
        assert (await http.delete("/v1/runs/pin/checkpoints/1")).status_code == 200
    gone = await _put(srv.url, "pin", {"step": 1})
    assert gone.status_code == 409 and "checkpoint was deleted" in gone.text
    assert (await _put(srv.url, "pin", {"step": 0})).json()["serving_step"] == 0
    assert (await _greedy(model, "pin"))[0] == 0
    back = await _put(srv.url, "pin", {"step": None})
    assert back.json() == {"run": "pin", "serving_step": 3, "latest_step": 3, "pinned": False}
    assert (await _greedy(model, "pin"))[0] == 3


HELD_OUT_SOLVED = {0: 2, 2: 7, 4: 1}  # of 8 held-out tasks, solved at each evaluated step: step 2 is the best


class _OneQuestion(Environment):
    """One question, no tools; a training rollout's reward is the parity of its answer's length, so
    that a group's members differ and the steps train."""

    def initial_messages(self):
        return [{"role": "system", "content": "You are a shop assistant."}, *PROMPT]

    async def call_tool(self, name, arguments):
        raise ToolError("no tools")

    async def score(self, messages) -> Score:
        return Score(reward=float(len(messages[-1].get("content") or "") % 2))


@dataclass
class _Declining(Example):
    """Held-out rewards scripted by the step evaluated (its `run@N` name), the sampling real: by
    default step 2 scores 7 of 8, step 4 1 of 8, a fall far past two standard errors."""

    solved: dict[int, int] = field(default_factory=lambda: HELD_OUT_SOLVED)

    def train_tasks(self, seed: int) -> list[Task]:
        return [Task(id=f"t{i}") for i in range(4)]

    def eval_tasks(self) -> list[Task]:
        return [Task(id=f"e{i}", metadata={"index": i}) for i in range(8)]

    def make_env(self, task: Task) -> Environment:
        return _OneQuestion()

    async def rollout(self, client, model, task):
        traj = await super().rollout(client, model, task)
        if task.id.startswith("e") and not isinstance(traj, BaseException):
            traj.reward = float(task.metadata["index"] < self.solved[int(model.rpartition("@")[2])])
        return traj


@dataclass
class _Slipping(_Declining):
    """Training rewards scripted by the step that sampled them: the rollouts of steps 0-3 score
    1, 1, 1, 0 in turn (a batch of 0.75), later ones 1, 0, 0, 0 (0.25); each group keeps a spread, so
    every step trains."""

    served: dict[int, int] = field(default_factory=dict)  # rollouts scored so far, by sampling step

    async def rollout(self, client, model, task):
        traj = await super().rollout(client, model, task)
        if task.id.startswith("t") and not isinstance(traj, BaseException):
            step = int(model.rpartition("@")[2])
            n = self.served[step] = self.served.get(step, 0) + 1
            traj.reward = float(n % 4 != 0) if step < 4 else float(n % 4 == 1)
        return traj


async def test_a_training_reward_that_falls_past_the_noise_is_named_on_the_step_that_sees_it(server, tmp_path, capsys):
    example = _Slipping(name="slipping", settings=RolloutSettings(max_turns=1, max_tokens=6, temperature=1.0),
                        solved={s: 4 for s in range(9)})
    cfg = LoopConfig(server=server.url, run="slipping", example="unused", steps=8, groups_per_step=1, group_size=4,
                     eval_every=0, eval_tasks=8, out=tmp_path, progress=False, seed=3,
                     train=TrainConfig(learning_rate=1e-3))
    summary = await train_loop(cfg, example)
    lines = capsys.readouterr().out.splitlines()

    assert [(h["step"], h["reward_mean"]) for h in summary["history"]] == [(s, 0.75 if s <= 4 else 0.25)
                                                                           for s in range(1, 9)]
    at8 = next(i for i, x in enumerate(lines) if x.startswith("step   8 |"))
    below = lines[at8 + 1:next((i for i in range(at8 + 1, len(lines)) if not lines[i].startswith("  ")), None)]
    # std of the eight batches over sqrt(4), times 2 sqrt(2): 0.378, below the fall of 0.5
    assert below[-1] == ("  warning: training reward fell from 0.750 (steps 1-4) to 0.250 (steps 5-8), more "
                         "than two standard errors (0.378): the policy is getting worse at tasks it solved "
                         "before, not facing harder ones; read a few failed rollouts, lower --learning-rate, "
                         "and --keep-best with --eval-every keeps the best step served")
    assert not any("training reward fell" in x for x in lines[:at8])  # seven batches: too few to compare
    assert [h["step"] for h in summary["history"] if h.get("training_reward_decline")] == [8]


async def test_keep_best_serves_the_best_step_of_a_run_that_fell_and_the_lines_say_so(server, tmp_path, capsys,
                                                                                       monkeypatch):
    # Every step's entropy counts as collapsed: what is checked here is that the step line carries the
    # warning (client/loop/decline.py's rule has its own tests).
    monkeypatch.setattr("client.loop.decline.ENTROPY_COLLAPSE_FRACTION", 1e9)
    example = _Declining(name="declining", settings=RolloutSettings(max_turns=1, max_tokens=6, temperature=1.0))
    cfg = LoopConfig(server=server.url, run="declining", example="unused", steps=4, groups_per_step=2, group_size=4,
                     eval_every=2, eval_tasks=8, out=tmp_path, progress=False, patience=5, seed=3,
                     train=TrainConfig(learning_rate=1e-3), keep_best=True)
    summary = await train_loop(cfg, example)
    out = capsys.readouterr().out
    lines = out.splitlines()

    assert [(e["step"], e["reward"]) for e in summary["evals"]] == [(0, 0.25), (2, 0.875), (4, 0.125)]
    assert summary["evals"][1]["stderr"] == pytest.approx(0.125)  # sqrt(7/8 * 1/8 * 8/7) / sqrt(8)
    at4 = lines.index("eval @ step 4: reward 0.125")
    assert lines[at4 + 1].startswith("  warning: held-out reward fell from 0.875 (step 2) to 0.125 (step 4), more "
                                     "than two standard errors (0.354): the policy is getting worse; likely too high "
                                     "a learning rate (--learning-rate, now 1e-3)")
    assert "--keep-best will serve step 2" in lines[at4 + 1]
    assert not any("held-out reward fell" in x for x in lines[:at4])  # step 2 rose: no warning there

    trained = [h for h in summary["history"] if h["trained"]]
    first = trained[0]["step"]  # what later steps compare with: it cannot warn itself
    # not where half the groups were solved by every rollout (low entropy there is the task learned)
    later = [h["step"] for h in trained[1:] if h["groups_constant_solved"] * 2 < h["groups_total"]]
    assert later, trained
    for step in later:
        at = next(i for i, x in enumerate(lines) if x.startswith(f"step {step:3d} |"))
        below = lines[at + 1:next(i for i in range(at + 1, len(lines)) if not lines[i].startswith("  "))]
        assert below[-1].startswith("  warning: entropy fell from ") and f"since step {first} " in below[-1], below
    assert [h["step"] for h in summary["history"] if h.get("entropy_collapse")] == later

    assert "--keep-best: run declining now serves step 2 (held-out 0.875); step 4 scored 0.125" in out
    assert "no better than" not in out  # step 2 rose past the noise: the fall is the news, not a lack of gain
    assert summary["best_step"] == {"step": 2, "reward": 0.875, "stderr": pytest.approx(0.125)}
    assert summary["keep_best"] == {"serving_step": 2, "reward": 0.875, "latest_step": 4, "latest_reward": 0.125}
    info = httpx.get(f"{server.url}/v1/runs/declining", timeout=30).json()
    assert (info["step"], info["serving_step"], info["serving_pinned"]) == (4, 2, True)


async def test_a_run_no_better_than_its_start_says_so_from_three_quarters_of_its_steps(server, tmp_path, capsys):
    example = _Declining(name="flat", settings=RolloutSettings(max_turns=1, max_tokens=6, temperature=1.0),
                         solved={0: 2, 2: 3, 4: 2})
    cfg = LoopConfig(server=server.url, run="flat", example="unused", steps=4, groups_per_step=2, group_size=4,
                     eval_every=2, eval_tasks=8, out=tmp_path, progress=False, patience=5, seed=3,
                     train=TrainConfig(learning_rate=1e-3))
    summary = await train_loop(cfg, example)
    lines = capsys.readouterr().out.splitlines()

    assert [(e["step"], e["reward"]) for e in summary["evals"]] == [(0, 0.25), (2, 0.375), (4, 0.25)]
    history = summary["history"]
    share = 1 - sum(h["groups_dropped_constant"] for h in history) / sum(h["groups_total"] for h in history)
    at = lines.index("eval @ step 4: reward 0.250")
    assert lines[at + 1].startswith("  warning: held-out reward is no better than at step 0 (0.250) after 4 steps: "
                                    "the best since, 0.375 at step 2, is within two standard errors"), lines[at + 1]
    assert f"{share:.0%} of its groups had a reward spread" in lines[at + 1]
    assert summary["evals"][2]["warnings"] == [lines[at + 1].removeprefix("  warning: ")]
    for quiet in ("eval @ step 0: reward 0.250", "eval @ step 2: reward 0.375"):  # step 2 of 4: too soon to say
        assert not lines[lines.index(quiet) + 1].startswith("  warning:")


@dataclass
class _OneReply(_Declining):
    """Held-out final replies scripted by the step evaluated: at step 0 every task is answered "12",
    later each its own number; the rewards are _Declining's."""

    async def rollout(self, client, model, task):
        traj = await super().rollout(client, model, task)
        if task.id.startswith("e") and not isinstance(traj, BaseException):
            step, index = int(model.rpartition("@")[2]), task.metadata["index"]
            traj.messages_and_choices[-1].message.content = "12" if step == 0 else f"{10 + index} legs"
        return traj


async def test_held_out_tasks_all_given_one_answer_are_named_on_the_evaluation_that_sees_it(server, tmp_path, capsys):
    example = _OneReply(name="one-reply", settings=RolloutSettings(max_turns=1, max_tokens=6, temperature=1.0),
                        solved={0: 2, 2: 7})
    cfg = LoopConfig(server=server.url, run="one-reply", example="unused", steps=2, groups_per_step=2, group_size=4,
                     eval_every=2, eval_tasks=8, out=tmp_path, progress=False, patience=5, seed=3,
                     train=TrainConfig(learning_rate=1e-3))
    summary = await train_loop(cfg, example)
    lines = capsys.readouterr().out.splitlines()

    assert [(e["step"], e["reward"]) for e in summary["evals"]] == [(0, 0.25), (2, 0.875)]
    at0 = lines.index("eval @ step 0: reward 0.250")
    said = "warning: 8 of 8 held-out tasks got the same final reply, '12', and held-out reward (0.250) is below"
    assert lines[at0 + 2].startswith(f"  {said}"), lines[at0:at0 + 3]  # below the line saying what is measured
    assert summary["evals"][0]["warnings"] == [lines[at0 + 2].removeprefix("  warning: ")]
    assert not any("same final reply" in w for w in summary["evals"][1].get("warnings", []))
