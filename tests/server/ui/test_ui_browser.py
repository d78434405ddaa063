"""The web UI in headless Chromium, against a live server holding a real short training run.

Chromium is Debian's (`make install` puts it at /usr/bin/chromium); playwright only drives it.
Screenshots land in test-artifacts/ui/ for a person to look at.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from client import TrainableModel, TrainResult, Trajectory, TrajectoryGroup
from conftest import ROOT, ServerProcess
from examples.demo import task as demo
from tests.helpers import demo_groups, with_rewards

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = ROOT / "test-artifacts" / "ui"
KEY = "ui-test-key"
RUN = "ui-demo"
# Rewards per training step (2 groups of 4 each); the second group of step 2 is constant and
# is dropped, which the health plots and the step's figures must show.
TRAIN_REWARDS = [[[0.0, 0.5, 1.0, 0.25], [1.0, 0.0, 0.0, 0.75]],
                 [[0.1, 0.9, 0.4, 0.6], [0.3, 0.3, 0.3, 0.3]]]
EVAL_REWARDS = [[0.2, 0.8, 0.6]]
DOMAINS = ("retail", "airline")  # the two groups of each step
FLAT = "ui-flat"  # a run that never learns: every attempt trains nothing


@pytest.fixture(scope="module")
async def trained(tmp_path_factory) -> str:
    """A keyed server with two RL steps on real demo rollouts and one logged eval group. Set up
    before `browser`: once playwright's sync API holds this thread, no coroutine runs in it."""
    srv = ServerProcess(tmp_path_factory.mktemp("ui-server"), api_key=KEY)
    try:
        srv.start()
        model = await TrainableModel(RUN, project="ui").register(srv.url, api_key=KEY)
        for i, rewards in enumerate(TRAIN_REWARDS):
            groups = with_rewards(await demo_groups(model, 2, 4, seed=10 + i), rewards)
            for g, domain in zip(groups, DOMAINS):  # a run over two task families
                g.metadata["domain"] = domain
            result = await model.train(groups)
            assert result.trained and result.step == i + 1
        await model.log([await _eval_group(model, EVAL_REWARDS[0])], split="val")
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def flat(trained) -> list[TrainResult]:
    """Two attempts on real sampled rollouts that cannot train: constant rewards, then groups of one."""
    async def go():
        model = await TrainableModel(FLAT, project="ui").register(trained, api_key=KEY)
        groups = await demo_groups(model, 2, 2, seed=30)
        constant = await model.train(with_rewards(groups, [[1.0, 1.0], [0.0, 0.0]]))
        alone = await model.train([TrajectoryGroup(trajectories=g.trajectories[:1]) for g in groups])
        return [constant, alone]
    # In a thread of its own: playwright's sync API keeps an event loop running in this one.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, go()).result()


async def _eval_group(model: TrainableModel, rewards: list[float]) -> TrajectoryGroup:
    """Answers sampled by the run after a worked tool call: the tool call is in every trajectory
    whatever the model's skill (the embedded model may or may not call tools on its own), and
    the answer is a real sampled Choice with token ids and logprobs."""
    task = demo.make_example().eval_tasks()[0]
    context = demo.demonstration(task, False, random.Random(0))[:4]  # system, user, tool call, result
    trajs = []
    async with model.openai_client(max_retries=0) as client:
        for r in rewards:
            resp = await client.chat.completions.create(model=model.name, messages=context, tools=demo.TOOLS,
                                                        max_tokens=24, temperature=1.0)
            trajs.append(Trajectory(messages_and_choices=[*context, resp.choices[0]], tools=demo.TOOLS, reward=r,
                                    metadata={**task.metadata, "task_id": task.id}))
    return TrajectoryGroup(trajectories=trajs)


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM.exists(), "Debian's chromium is missing: run `make install` (apt-get install chromium)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(trained, browser):
    """A fresh tab that has typed the key into the page's key form, plus every JS error it hits."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    p.goto(trained + "/ui/")
    _settled(p, "key")
    p.fill("#key-form input[name=key]", KEY)
    p.click("#key-form button")
    _settled(p, "runs")
    errors.clear()  # the browser logs the keyless request's 401 as an error; that one is expected
    yield p
    context.close()
    assert errors == [], errors  # a CSP refusal or a JS exception is a broken page


def _settled(page: Page, view: str) -> None:
    """Wait until the page shows `view` for the URL it is at now (not the one before)."""
    page.wait_for_function("v => document.body.dataset.ready === v && document.body.dataset.hash === location.hash", arg=view)


def _go(page: Page, hash_: str, view: str) -> None:
    page.evaluate("h => { location.hash = h }", hash_)
    _settled(page, view)


def _shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _api(url: str, path: str, **params) -> dict:
    r = httpx.get(url + path, params=params, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_data_routes_need_the_key(trained):
    tid = _api(trained, f"/ui/api/runs/{RUN}/trajectories", limit=1)["data"][0]["id"]
    paths = ["/ui/api/runs", f"/ui/api/runs/{RUN}", f"/ui/api/runs/{RUN}/steps/1/groups", f"/ui/api/runs/{RUN}/attempts",
             f"/ui/api/runs/{RUN}/trajectories", f"/ui/api/trajectories/{tid}"]
    for path in paths:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(trained + path, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert RUN not in r.text
        assert httpx.get(trained + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    # The page itself carries no data, so it loads and asks for the key.
    r = httpx.get(trained + "/ui/", timeout=30)
    assert r.status_code == 200 and RUN not in r.text


def test_runs_list_and_run_page_plots(page: Page, trained):
    row = page.locator(f'#runs tr[data-run="{RUN}"]')
    assert row.count() == 1
    cells = row.locator("td").all_inner_texts()
    assert cells[:3] == [RUN, "ui", "2"]
    last_train = sum(TRAIN_REWARDS[-1][0] + TRAIN_REWARDS[-1][1]) / 8
    assert float(cells[3]) == pytest.approx(last_train, abs=1e-3)
    _shot(page, "runs")

    row.locator("a").click()
    _settled(page, "run")
    reward = page.locator('figure[data-metric="reward"]')
    train_pts = reward.locator('g[data-series="train"] circle.pt')
    eval_pts = reward.locator('g[data-series="eval (val)"] circle.pt')
    assert train_pts.count() == 2 and eval_pts.count() == 1
    assert reward.locator('g[data-series="train"] polyline').count() == 1
    ys = [float(train_pts.nth(i).get_attribute("data-y")) for i in range(2)]
    assert ys == pytest.approx([sum(sum(g) for g in step) / 8 for step in TRAIN_REWARDS])
    # a higher reward is drawn higher: the y axis is not upside down
    cy = [float(train_pts.nth(i).get_attribute("cy")) for i in range(2)]
    assert (cy[0] < cy[1]) == (ys[0] > ys[1])
    for metric in ("logprob_gap", "lora_update_norm", "entropy", "clip_fraction", "grad_norm", "kl_to_base",
                   "trainable_tokens", "groups_dropped_constant"):
        pts = page.locator(f'figure[data-metric="{metric}"] circle.pt')
        assert pts.count() == 2, metric
        assert all(math.isfinite(float(pts.nth(i).get_attribute("cy"))) for i in range(2)), metric
    dropped = page.locator('figure[data-metric="groups_dropped_constant"] circle.pt')
    assert [dropped.nth(i).get_attribute("data-y") for i in range(2)] == ["0", "1"]
    # per domain: a line per domain in each of the figures the steps report for it
    by_domain = page.locator('#domains figure[data-metric="domains.reward_mean"]')
    for d, domain in enumerate(DOMAINS):
        pts = by_domain.locator(f'g[data-series="{domain}"] circle.pt')
        assert [float(pts.nth(i).get_attribute("data-y")) for i in range(2)] == \
            pytest.approx([sum(step[d]) / 4 for step in TRAIN_REWARDS])
    assert page.locator('#domains figure[data-metric="domains.excluded"] circle.pt').count() == 4
    # each step's warnings, as the server reported them
    steps = _api(trained, f"/v1/runs/{RUN}")["steps"]
    for s in steps:
        shown = page.locator(f'#steps tr[data-step="{s["step"]}"] ul.warnings li').all_inner_texts()
        assert shown == s["warnings"]
    # both jobs trained: two attempts, each the step it became
    assert page.locator('#attempts tbody tr[data-trained="true"]').count() == 2
    assert page.locator('#attempts tbody tr[data-trained="false"]').count() == 0
    assert page.locator("#attempts-summary").inner_text() == "2 step attempts, all trained."
    _shot(page, "run")


def test_attempts_that_train_nothing_show_why_on_the_run_page(page: Page, trained, flat):
    constant, alone = flat
    assert not constant.trained and not alone.trained
    _go(page, f"#/run/{FLAT}", "run")
    summary = page.locator("#attempts-summary")
    assert summary.is_visible() and summary.inner_text() == "2 of 2 step attempts trained nothing; their warnings say why."
    attempts = _api(trained, f"/ui/api/runs/{FLAT}/attempts")["data"]
    assert [(a["attempt"], a["step"], a["trained"], a["outcome"]) for a in attempts] == [
        (1, 1, False, "untrained"), (2, 1, False, "untrained")]
    assert page.locator("#attempts tbody tr").count() == 2
    for a, result in zip(attempts, flat):
        row = page.locator(f'#attempts tr[data-attempt="{a["attempt"]}"]')
        assert row.get_attribute("data-trained") == "false" and "untrained" in row.get_attribute("class").split()
        assert row.locator(".outcome").inner_text() == "nothing trained"
        shown = row.locator("ul.warnings li")
        assert shown.all_inner_texts() == a["warnings"] == result.warnings
        assert all(shown.nth(i).is_visible() for i in range(shown.count()))
    first, second = (page.locator(f'#attempts tr[data-attempt="{n}"] ul.warnings').inner_text() for n in (1, 2))
    assert "same reward for every rollout" in first
    assert "a group of one trajectory cannot train: group-relative advantages need at least two rollouts per " \
           "task; raise the group size" in second and "same reward" not in second
    assert page.locator("#steps").count() == 0  # no step landed
    _shot(page, "attempts")


def test_step_groups_and_a_trajectory_as_a_chat_with_coloured_tokens(page: Page, trained):
    _go(page, f"#/run/{RUN}/step/2?split=train", "step")
    spreads = [float(x) for x in page.locator("#groups tbody tr").evaluate_all("rs => rs.map(r => r.dataset.spread)")]
    assert len(spreads) == 2 and spreads == sorted(spreads, reverse=True) and spreads[-1] == 0
    _shot(page, "step")

    page.locator("#groups tbody tr").first.locator("td a").first.click()
    _settled(page, "group")
    assert page.locator("#group .column").count() == 4
    _shot(page, "group")

    # an eval trajectory: a tool call, its result, then the answer the run sampled
    row = _api(trained, f"/ui/api/runs/{RUN}/trajectories", split="val")["data"][0]
    traj = _api(trained, f"/ui/api/trajectories/{row['id']}")
    _go(page, f"#/traj/{traj['id']}", "trajectory")
    items = traj["data"]["messages_and_choices"]
    choices = [i for i in items if "finish_reason" in i]
    call = items[2]["tool_calls"][0]["function"]
    assert page.locator(".tool-call .tool-name").first.inner_text() == f"{call['name']}(…)"
    assert json.loads(page.locator(".tool-call .tool-args").first.inner_text()) == json.loads(call["arguments"])
    assert page.locator(".msg.role-tool .content").inner_text() == items[3]["content"]
    assert page.locator(".msg.role-system").count() == 1 and page.locator(".msg.role-user").count() == 1
    assert page.locator(".msg.sampled").count() == len(choices) == 1
    assert page.locator("#reward").inner_text() == f"reward {traj['reward']:g}"

    logprobs = [t["logprob"] for c in choices for t in c["logprobs"]["content"]]
    spans = page.locator("span.tok[data-logprob]")
    assert spans.count() == len(logprobs) > 0
    styled = spans.evaluate_all("ss => ss.map(s => [s.style.backgroundColor, s.title, Number(s.dataset.logprob)])")
    assert all(bg for bg, _, _ in styled), "every token gets a colour"
    assert [lp for _, _, lp in styled] == pytest.approx(logprobs)
    assert all("logprob" in title for _, title, _ in styled)
    # the colour follows the logprob: the least and the most likely tokens differ
    lo, hi = min(styled, key=lambda s: s[2]), max(styled, key=lambda s: s[2])
    assert lo[2] < hi[2] and lo[0] != hi[0]
    _shot(page, "trajectory")


def test_filters_change_the_listed_trajectories(page: Page, trained):
    _go(page, f"#/run/{RUN}", "run")
    all_rewards = [r for step in TRAIN_REWARDS for g in step for r in g] + EVAL_REWARDS[0]
    table = page.locator("#trajectories")
    assert int(table.get_attribute("data-count")) == len(all_rewards)

    page.fill("#filters input[name=min_reward]", "0.5")
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => location.hash.includes('min_reward=0.5')")
    _settled(page, "run")
    shown = [float(x) for x in page.locator("#trajectories tbody tr").evaluate_all("rs => rs.map(r => r.dataset.reward)")]
    assert sorted(shown) == sorted(r for r in all_rewards if r >= 0.5)
    assert page.locator("#filters input[name=min_reward]").input_value() == "0.5"  # the form keeps the filter
    _shot(page, "filtered")

    page.fill("#filters input[name=min_reward]", "")
    page.select_option("#filters select[name=split]", "val")
    page.fill("#filters input[name=meta]", f"task_id={_api(trained, f'/ui/api/runs/{RUN}/trajectories', split='val')['data'][0]['metadata']['task_id']}")
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => location.hash.includes('meta_key=task_id')")
    _settled(page, "run")
    assert int(page.locator("#trajectories").get_attribute("data-count")) == len(EVAL_REWARDS[0])

    page.fill("#filters input[name=q]", "no such text anywhere")
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => location.hash.includes('q=no')")
    _settled(page, "run")
    assert int(page.locator("#trajectories").get_attribute("data-count")) == 0
