"""Per-domain step figures (protocol/domains.py), the train CLI's example options, and the server
reporting them for a submitted step."""

from __future__ import annotations

import pytest

from client.errors import ConfigError
from client.loop.examples import example_options, load_example
from client.loop.report import domain_lines
from protocol.domains import domain_figures, exception_kind
from protocol.trajectory import Trajectory, TrajectoryGroup


def traj(reward: float, domain: str | None = None, **metrics) -> Trajectory:
    return Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=reward, metrics=metrics,
                      metadata={"domain": domain} if domain else {})


@pytest.mark.unit
def test_figures_per_domain_count_failures_by_kind_and_average_shared_metrics():
    groups = [
        TrajectoryGroup(trajectories=[traj(1.0, success=True, turns=3, stop_answered=1),
                                      traj(0.0, success=False, turns=5)],
                        exceptions=["UserSimulatorError: user simulator openai/x: empty (at a.py:1)"],
                        metadata={"domain": "retail"}),
        # the group names no domain: its trajectories do
        TrajectoryGroup(trajectories=[traj(0.5, "airline", success=False, turns=2)]),
        # every rollout failed: only the group says where
        TrajectoryGroup(exceptions=["openai.APIConnectionError: refused", "UserSimulatorError: x"],
                        metadata={"domain": "airline"}),
        TrajectoryGroup(trajectories=[traj(0.0)]),  # no domain anywhere: not in any domain's figures
    ]
    figures = domain_figures(groups)
    assert set(figures) == {"retail", "airline"}
    retail = figures["retail"]
    assert retail["trajectories"] == 2 and retail["excluded"] == 1 and retail["excluded_UserSimulatorError"] == 1
    assert retail["reward_mean"] == 0.5 and retail["success"] == 0.5 and retail["turns"] == 4.0
    assert "stop_answered" not in retail  # one trajectory lacks it: no mean that means anything
    airline = figures["airline"]
    assert airline["trajectories"] == 1 and airline["excluded"] == 2 and airline["reward_mean"] == 0.5
    assert airline["excluded_APIConnectionError"] == 1 and airline["excluded_UserSimulatorError"] == 1
    assert domain_figures([TrajectoryGroup(trajectories=[traj(1.0)])]) == {}
    assert exception_kind("no colon here") == "Exception"
    assert domain_lines({"retail": {"reward_mean": 0.5, "excluded": 1}}) == ["\n  retail: reward_mean 0.5, excluded 1"]


@pytest.mark.unit
def test_the_example_takes_options_the_command_does_not_know():
    assert example_options(["--domain", "retail", "--domain=airline", "--user-model", "gpt-4.1", "--fast"]) == \
        {"domain": ["retail", "airline"], "user_model": "gpt-4.1", "fast": True}
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        example_options(["stray"])
    with pytest.raises(ConfigError, match="^--domain: no such option of --example demo$"):
        load_example("demo", domain="retail")
    with pytest.raises(ConfigError, match="^--name: --example reasoning_gym sets it itself$"):
        load_example("reasoning_gym", name="mine")  # not load_example's own `name`
    with pytest.raises(ConfigError, match="^--example reasoning_gym: reasoning-gym has no task 'chain_summ'; "
                                          "did you mean chain_sum"):
        load_example("reasoning_gym", task="chain_summ")
    # strings from the command line become what the example declares, through make_example's
    # parameters or the fields of the dataclass it returns
    email = load_example("email", **example_options(["--judge-weight", "0.25", "--size", "500"]))
    assert (email.judge_weight, email.size) == (0.25, 500)
    assert load_example("reasoning_gym", **example_options(["--n-train", "16"])).n_train == 16
    with pytest.raises(ConfigError, match="--judge-weight 'half': Input should be a valid number"):
        load_example("email", judge_weight="half")


async def test_a_step_reports_its_figures_per_domain(server):
    """The server's step figures carry them (the demo task, two domains named by hand)."""
    from client import TrainConfig, TrainableModel
    from client.loop.rollout_source import run_groups
    from examples.demo.task import make_example

    example = make_example()
    tasks = example.train_tasks(seed=0)[:2]
    for task, domain in zip(tasks, ("shop-a", "shop-b")):
        task.metadata["domain"] = domain

    model = await TrainableModel("domains-run").register(server.url)
    groups = await run_groups(model, example, tasks, group_size=2, progress=False)
    assert [g.metadata["domain"] for g in groups] == ["shop-a", "shop-b"]
    result = await model.train(groups, TrainConfig())
    for domain, g in zip(("shop-a", "shop-b"), groups):
        figures = result.metrics.domains[domain]
        assert figures["trajectories"] == len(g.trajectories)
        assert figures["reward_mean"] == pytest.approx(sum(t.reward for t in g.trajectories) / len(g.trajectories))
        assert figures["turns"] == pytest.approx(sum(t.metrics["turns"] for t in g.trajectories) / len(g.trajectories))
