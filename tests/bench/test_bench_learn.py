"""bench/learn.py's pieces that decide its figures: the task both trainers see, and how two
learning curves are compared. (The benchmark itself is run with `make bench-learn`.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from examples import reasoning_gym as learn_task

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))




def test_the_fewshot_prompt_puts_solved_questions_of_the_same_dataset_before_the_question():
    [row] = learn_task.rows("chain_sum", 1, learn_task.EVAL_SEED)
    msgs = learn_task.messages(row, "fewshot")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[-1]["content"] == row["question"]
    shots = learn_task.rows("chain_sum", learn_task.FEWSHOT_N, learn_task.FEWSHOT_SEED)
    assert [msgs[2]["content"], msgs[4]["content"]] == [str(s["answer"]) for s in shots]
    assert learn_task.messages(row, "fewshot") == msgs  # every prompt of a run is the same


@pytest.mark.parametrize("task", ["products", "leg_counting"])  # leg_counting's pool repeats questions
def test_drawn_shots_differ_between_questions_and_stay_the_same_for_one(task):
    rows = learn_task.rows(task, 64, learn_task.EVAL_SEED)
    pool = {(s["question"], str(s["answer"])) for s in learn_task.rows(task, learn_task.FEWSHOT_POOL,
                                                                         learn_task.FEWSHOT_SEED)}

    def shots(row):
        msgs = learn_task.messages(row, "fewshot_drawn")
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert msgs[-1]["content"] == row["question"]
        return [(msgs[i]["content"], msgs[i + 1]["content"]) for i in (1, 3)]

    drawn = [shots(r) for r in rows]
    for row, pair in zip(rows, drawn):
        assert set(pair) <= pool and pair[0][0] != pair[1][0] and row["question"] not in {q for q, _ in pair}
        assert shots(row) == pair  # a question's prompt is the same at every sample and evaluation
    assert len({tuple(p) for p in drawn}) > len(drawn) // 2  # not one fixed pair to copy answers from


def test_train_and_held_out_rows_are_other_questions():
    train = {r["question"] for r in learn_task.rows("chain_sum", 64, learn_task.TRAIN_SEED)}
    held_out = [r["question"] for r in learn_task.rows("chain_sum", 64, learn_task.EVAL_SEED)]
    assert len(train & set(held_out)) < len(held_out)  # one-digit sums repeat; the sets are not the same draw


def test_the_reward_is_reasoning_gyms_score_of_the_bare_or_tagged_answer():
    [row] = learn_task.rows("chain_sum", 1, 0)
    answer = str(row["answer"])
    assert learn_task.score(answer, row) == 1.0
    assert learn_task.score(f" {answer}\n", row) == 1.0
    assert learn_task.score(f"I think <answer>{answer}</answer>", row) == 1.0
    assert learn_task.score(f"The answer is {answer}.", row) < 1.0
    assert learn_task.score(None, row) == 0.0


async def test_the_exact_reward_pays_full_credit_alone():
    """score_answer's default pays a reply that contains the answer in part: "10" gets 0.5 where the
    answer is 0. `--reward exact` (client.train's example option, and the bench's) pays 1 or 0."""
    from client.errors import ConfigError
    from client.loop.examples import load_example
    from rewards.reasoning_gym import exact_reply
    from rollouts.env import Task

    row = next(r for r in learn_task.rows("leg_counting", 64, learn_task.EVAL_SEED) if r["answer"] == "0")
    assert learn_task.score("10", row) == 0.5 and exact_reply("10", row) == 0.0
    assert exact_reply("0", row) == exact_reply("<answer>0</answer>", row) == 1.0 and exact_reply(None, row) == 0.0
    task = Task(id="t", data={"row": row})
    reply = [{"role": "assistant", "content": "10"}]
    plain, exact = load_example("reasoning_gym", task="leg_counting"), load_example("reasoning_gym", reward="exact")
    assert (await plain.make_env(task).score(reply)).reward == 0.5
    assert (await exact.make_env(task).score(reply)).reward == 0.0
    with pytest.raises(ConfigError, match="--reward 'partial'"):
        load_example("reasoning_gym", reward="partial")


def test_trl_stops_at_the_tokens_art_server_is_told_to_stop_at(tmp_path):
    """A base model's sweep gives art-server `--stop-token '\\n'`; TRL gets the same ids as EOS ids
    of its generation config, which GRPOTrainer stops its samples at and masks after."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.families import tokenizer_dir

    learn = _load("learn")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("qwen2_5", tmp_path))
    [newline] = tokenizer.encode("\n", add_special_tokens=False)
    for eos, kept in ((7, [7]), ([9, 7], [7, 9]), (None, [])):
        config = GenerationConfig(eos_token_id=eos)
        learn._add_stop_tokens(config, tokenizer, learn_task.BASE_MODEL_STOP)
        assert config.eos_token_id == sorted({*kept, newline})


def test_time_ratio_compares_seconds_to_reach_trls_final_accuracy():
    learn = _load("learn")
    trl = [[0.0, 0, 0.2], [10.0, 5, 0.3], [20.0, 10, 0.5]]
    artisan = [[0.0, 0, 0.2], [4.0, 5, 0.5], [8.0, 10, 0.6]]
    out = learn.compare(artisan, trl)
    assert out["time_ratio_to_trl_final"] == pytest.approx(0.2)  # 4 s vs 20 s to reach 0.5
    assert out["time_ratio_per_step"] == pytest.approx(0.4)
    assert learn.compare([[0.0, 0, 0.2], [8.0, 10, 0.3]], trl)["time_ratio_to_trl_final"] is None  # never reached
    flat = [[0.0, 0, 0.2], [20.0, 10, 0.2]]
    assert learn.compare(artisan, flat)["time_ratio_to_trl_final"] is None  # TRL learned nothing: nothing to time


# ---- bench/learn_sweep.py's aggregation -----------------------------------------------------------

def test_mean_and_standard_error_over_seeds():
    sweep = _load("learn_sweep")
    out = sweep.mean_se([0.2, 0.4, 0.6])
    assert out["mean"] == pytest.approx(0.4) and out["n"] == 3
    assert out["se"] == pytest.approx(0.2 / 3 ** 0.5, abs=1e-4)  # sample std 0.2 over sqrt 3
    assert sweep.mean_se([0.3])["se"] is None  # one seed measures no spread
    assert sweep.mean_se([]) == {"mean": None, "se": None, "n": 0}


def test_rise_and_the_verdicts_on_it():
    sweep = _load("learn_sweep")
    assert sweep.rise(0.1, 0.35) == pytest.approx(0.25)
    assert sweep.ends_below_base(sweep.rise(0.3, 0.25)) and not sweep.ends_below_base(0.0)
    assert sweep.rises_by(sweep.rise(0.2, 0.3)) and not sweep.rises_by(0.0999)  # 0.10 exactly counts


def test_artisan_at_least_trl_within_noise():
    sweep = _load("learn_sweep")
    trl = {"mean": 0.20, "se": 0.03}
    assert sweep.at_least_within_noise({"mean": 0.25, "se": 0.04}, trl)  # above
    assert sweep.at_least_within_noise({"mean": 0.12, "se": 0.03}, trl)  # 0.08 below; 2 SE of the gap is 0.085
    assert not sweep.at_least_within_noise({"mean": 0.10, "se": 0.02}, trl)  # 0.10 below, 2 SE is 0.072
    assert sweep.at_least_within_noise({"mean": 0.5, "se": None}, trl) is None  # one seed: no noise to judge by


def _entry(task, trainer, seed, base, final):
    return {"task": task, "trainer": trainer, "seed": seed, "base": base, "final": final, "seconds_per_step": 1.0,
            "curve": [[0.0, 0, base], [1.0, 2, (base + final) / 2], [2.0, 4, final]]}


def test_summary_per_task_and_trainer_over_seeds():
    sweep = _load("learn_sweep")
    entries = [_entry("leg_counting", "artisan", s, 0.1, f) for s, f in enumerate([0.3, 0.4, 0.35])]
    entries += [_entry("leg_counting", "trl", s, 0.1, f) for s, f in enumerate([0.05, 0.1, 0.0])]
    out = sweep.summarize(entries)["leg_counting"]
    assert out["family"] == "counting"
    art, trl = out["artisan"], out["trl"]
    assert art["base"]["mean"] == pytest.approx(0.1) and art["base"]["se"] == 0.0
    assert art["final"]["mean"] == pytest.approx(0.35) and art["rise"]["mean"] == pytest.approx(0.25)
    assert art["rises_by_0.10"] and not art["ends_below_base"]
    assert trl["ends_below_base"] and not trl["rises_by_0.10"]  # 0.05 on average: below its 0.1 start
    assert art["seeds"]["1"] == {"base": 0.1, "final": 0.4, "rise": pytest.approx(0.3), "seconds_per_step": 1.0,
                                 "rise_beyond_shuffled": None, "top_reply": None}
    assert out["artisan_at_least_trl_within_noise"] is True
    assert "artisan_at_least_trl_within_noise" not in sweep.summarize(entries[:3])["leg_counting"]  # one trainer


def test_time_ratios_pair_each_task_and_seed_and_take_the_median():
    sweep = _load("learn_sweep")

    def run(task, trainer, seed, curve):
        return {"task": task, "trainer": trainer, "seed": seed, "curve": curve}

    trl = [[0.0, 0, 0.2], [10.0, 2, 0.3], [20.0, 4, 0.5]]
    entries = [run("a", "trl", 0, trl), run("a", "artisan", 0, [[0.0, 0, 0.2], [4.0, 2, 0.5], [8.0, 4, 0.6]]),
               run("b", "trl", 0, trl), run("b", "artisan", 0, [[0.0, 0, 0.2], [6.0, 2, 0.6], [9.0, 4, 0.6]]),
               run("c", "trl", 0, trl), run("c", "artisan", 0, [[0.0, 0, 0.2], [5.0, 4, 0.4]]),
               run("d", "trl", 0, [[0.0, 0, 0.3], [20.0, 4, 0.3]]), run("d", "artisan", 0, trl),
               run("e", "artisan", 0, trl)]
    out = sweep.time_ratios(entries)
    # c never reached TRL's 0.5: the slowest; d: TRL learned nothing, no time to compare; e: no TRL run
    assert out["pairs"] == {"a/0": pytest.approx(0.2), "b/0": pytest.approx(0.3), "c/0": "never", "d/0": None}
    assert out["median"] == pytest.approx(0.3)
    assert sweep.time_ratios(entries[:2] + entries[4:6])["median"] == "never"  # a and c: the middle is never


def test_a_steps_time_split_puts_what_the_server_did_not_measure_under_other():
    learn = _load("learn")
    from protocol.metrics import StepMetrics

    m = StepMetrics(queue_seconds=0.5, assembly_seconds=0.25, forward_seconds=2.0, backward_seconds=3.0,
                    optimizer_seconds=0.25, checkpoint_seconds=0.5, publish_seconds=1.0)
    split = learn.step_split(10.0, 8.0, m)
    assert split == {"sample": 10.0, "queue": 0.5, "assembly": 0.25, "forward": 2.0, "backward": 3.0,
                     "optimizer": 0.25, "checkpoint": 0.5, "publish": 1.0, "other": 0.5}
    three = [split, {**split, "forward": 4.0}, {**split, "forward": 1.0}]
    out = learn.median_split(three)
    assert out["median_seconds"]["forward"] == 2.0 and sum(out["median_seconds"].values()) == 18.0
    assert out["share"]["sample"] == pytest.approx(10 / 18, abs=1e-3)
    assert learn.median_split([]) == {}


def test_a_rise_to_the_constant_answers_accuracy_is_named_as_no_evidence():
    """syllogism went 0.297 -> 0.703 in 4 steps: 45 of its 64 held-out answers are "Yes"."""
    sweep = _load("learn_sweep")
    assert sweep.constant_answer(["Yes"] * 45 + ["No"] * 19) == {"answer": "Yes", "share": 0.7031}
    assert sweep.constant_answer([]) == {"answer": None, "share": None}
    entries = [{**_entry("syllogism", "artisan", s, 0.297, 0.703), "constant_answer": {"answer": "Yes", "share": 0.7031}}
               for s in range(2)]
    entries.insert(0, _entry("syllogism", "artisan", 2, 0.297, 0.703))  # a run from before the figure was kept
    out = sweep.summarize(entries)["syllogism"]
    assert out["constant_answer"]["answer"] == "Yes"
    assert out["artisan"]["rises_by_0.10"] and out["artisan"]["no_better_than_constant_answer"] is True
    assert sweep.no_better_than_constant(0.75, 0.7031) is False and sweep.no_better_than_constant(0.5, None) is None


def test_a_rise_that_does_not_depend_on_the_question_is_told_from_learning():
    """A policy answering one thing to all scores its accuracy on shuffled replies too; so does a
    reply the scorer pays in part whatever the question (leg_counting's "10", 0.5 wherever the answer is 0)."""
    scores = _load("greedy_scores")
    rows = learn_task.rows("leg_counting", 64, learn_task.EVAL_SEED)
    collapsed = scores.held_out(["12"] * 64, rows)
    assert collapsed["accuracy"] > 0.2 and collapsed["shuffled"] == pytest.approx(collapsed["accuracy"], abs=0.02)
    partial = scores.held_out(["10"] * 64, rows)
    assert partial["accuracy"] > sum(str(r["answer"]) == "10" for r in rows) / 64  # the half credits on "0"
    assert partial["shuffled"] == pytest.approx(partial["accuracy"], abs=0.02)
    right = scores.held_out([str(r["answer"]) for r in rows], rows)
    assert right["accuracy"] == 1.0 and right["shuffled"] < 0.3
    sweep = _load("learn_sweep")
    assert scores.beyond_shuffled(collapsed) < 0.02 and scores.beyond_shuffled(right) > 0.7

    def run(task, seed, final, beyond):
        return {**_entry(task, "artisan", seed, 0.04, final),
                "beyond_shuffled": {"base": 0.03, "final": 0.03 + beyond, "rise": beyond}}

    tasks = sweep.summarize([run("leg_counting", s, 0.266, 0.01) for s in range(3)] +
                            [run("chain_sum", s, 0.45, 0.3) for s in range(3)] +
                            [_entry("products", "artisan", s, 0.1, 0.25) for s in range(2)] +  # kept no replies
                            [run("products", 2, 0.25, 0.2)])
    legs = tasks["leg_counting"]["artisan"]
    assert legs["rises_by_0.10"] and legs["rises_by_0.10_beyond_shuffled"] is False
    assert legs["rise_beyond_shuffled"] == {"mean": 0.01, "se": 0.0, "n": 3}
    assert tasks["chain_sum"]["artisan"]["rises_by_0.10_beyond_shuffled"] is True
    assert tasks["products"]["artisan"]["rises_by_0.10_beyond_shuffled"] is None  # not every seed's replies
    tally = sweep.tally(tasks, "artisan")
    assert tally["rises_by_0.10"] == ["leg_counting", "chain_sum", "products"]
    assert tally["rises_by_0.10_beyond_shuffled"] == ["chain_sum"] and tally["beyond_shuffled_unknown"] == ["products"]
    assert tally["tasks"] == 3 and tally["ends_below_base"] == [] and sweep.tally(tasks, "trl")["tasks"] == 0
    assert sweep.top_reply(["12"] * 3 + ["4"]) == {"reply": "12", "share": 0.75}


def test_an_evaluation_keeps_each_questions_reply_and_score():
    scores = _load("greedy_scores")
    rows = learn_task.rows("leg_counting", 2, learn_task.EVAL_SEED)
    out = scores.held_out([f"  {rows[0]['answer']} \n", "no idea"], rows)
    assert out == {"accuracy": 0.5, "replies": [str(rows[0]["answer"]), "no idea"], "scores": [1.0, 0.0],
                   "shuffled": scores.shuffled([str(rows[0]["answer"]), "no idea"], rows)}
    assert scores.first_and_last([{"a": 0}, {"a": 1}, {"a": 2}]) == {"base": {"a": 0}, "final": {"a": 2}}


async def test_dynamic_sampling_replaces_groups_that_scored_alike_up_to_its_budget():
    """bench/learn.py --dynamic-sampling N: artisan's step sets aside groups with no signal and samples
    the next questions in their place, N at most; past that, groups go in as they come."""
    from protocol.trajectory import Trajectory, TrajectoryGroup

    learn = _load("learn")
    rewards = {0: [0, 0], 1: [1, 0], 2: [1, 1], 3: [0, 0], 4: [0, 1], 5: [0, 0], 6: [1, 0]}
    drawn: list[list[int]] = []

    async def sample(batch):
        drawn.append(batch)
        return [TrajectoryGroup(trajectories=[Trajectory(reward=r) for r in rewards[q]], metadata={"q": q})
                for q in batch]

    groups, aside = await learn.step_groups(sample, iter(range(7)), 2, max_set_aside=2)
    # 0 and 2 set aside (2 all solved), and 3, alike too, goes in: the budget is spent
    assert [g.metadata["q"] for g in groups] == [1, 3] and aside == 2 and drawn == [[0, 1], [2], [3]]
    drawn.clear()
    groups, aside = await learn.step_groups(sample, iter(range(7)), 2, max_set_aside=0)  # off: as they come
    assert [g.metadata["q"] for g in groups] == [0, 1] and aside == 0 and drawn == [[0, 1]]
    groups, aside = await learn.step_groups(sample, iter(range(7)), 3, max_set_aside=1)
    assert [g.metadata["q"] for g in groups] == [1, 2, 3] and aside == 1


def test_a_runs_key_names_the_reward_and_dynamic_sampling_only_where_they_are_not_the_default():
    # The committed runs' keys predate both options: a default run must keep its key, and TRL, which
    # has no dynamic sampling, is compared with artisan's dynamic-sampling runs by its runs without.
    import argparse

    sweep = _load("learn_sweep")
    base = dict(prompt="fewshot_drawn", steps=16, eval_every=4, eval_n=64, group_size=8, prompts_per_step=4, lr=2e-4,
                temperature=1.0, max_tokens=8)
    plain = argparse.Namespace(**base, reward="score_answer", dynamic_sampling=0)
    assert sweep._config(plain, "chain_sum") == sweep._config(plain, "chain_sum", "trl") == base
    varied = argparse.Namespace(**base, reward="exact", dynamic_sampling=8)
    assert sweep._config(varied, "chain_sum") == base | {"reward": "exact", "dynamic_sampling": 8}
    assert sweep._config(varied, "chain_sum", "trl") == base | {"reward": "exact"}


def test_mean_curve_averages_the_seeds_at_each_step():
    sweep = _load("learn_sweep")
    curve = sweep.mean_curve([[[0.0, 0, 0.1], [5.0, 4, 0.3]], [[0.0, 0, 0.1], [6.0, 4, 0.5]]])
    assert [p[:2] for p in curve] == [[0, 0.1], [4, 0.4]]
    assert curve[0][2] == 0.0 and curve[1][2] == pytest.approx(0.1)


def test_a_rerun_skips_the_runs_the_results_file_holds():
    sweep = _load("learn_sweep")
    configs = {(t, tr): {"steps": 16} for t in ("leg_counting", "syllogism") for tr in ("artisan", "trl")}
    done = {sweep.run_key("smollm2", {"steps": 16}, "leg_counting", 0, "artisan"),
            sweep.run_key("smollm2", {"steps": 2}, "leg_counting", 1, "artisan"),  # other settings: not this run
            sweep.run_key("gemma3", {"steps": 16}, "syllogism", 0, "trl")}  # another model
    assert sweep.pending(done, "smollm2", configs, [0, 1]) == [
        ("leg_counting", 0, "trl"), ("leg_counting", 1, "artisan"), ("leg_counting", 1, "trl"),
        ("syllogism", 0, "artisan"), ("syllogism", 0, "trl"), ("syllogism", 1, "artisan"), ("syllogism", 1, "trl")]


def test_the_committed_sweep_results_hold_each_run_once_whole_and_with_its_commit():
    # The file a sweep is finished from, on whatever machine: a line lost or written twice there
    # changes a mean silently.
    sweep = _load("learn_sweep")
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(sweep.RESULTS)], cwd=sweep.ROOT,
                             capture_output=True)
    assert tracked.returncode == 0, f"{sweep.RESULTS} is not committed"
    entries = sweep.read_results(sweep.RESULTS)
    keys = [sweep.run_key(e["model"], e["config"], e["task"], e["seed"], e["trainer"]) for e in entries]
    assert len(keys) == len(set(keys))
    for e in entries:
        assert e["commit"] and e["trainer"] in sweep.TRAINERS
        assert e["curve"][0][1] == 0 and e["curve"][-1][1] == e["config"]["steps"]
        assert (e["base"], e["final"]) == (e["curve"][0][2], e["curve"][-1][2])
        if "held_out" in e:  # the replies are those of the evaluations the line's figures are
            held = e["held_out"]
            assert (held["base"]["accuracy"], held["final"]["accuracy"]) == (e["base"], e["final"])
            assert len(held["final"]["replies"]) == len(held["final"]["scores"]) == e["config"]["eval_n"]
    assert set(sweep.summarize(entries)) == {e["task"] for e in entries}


def test_the_sweeps_tasks_have_settings_and_cover_at_least_three_families():
    sweep = _load("learn_sweep")
    assert set(sweep.FAMILIES) <= set(learn_task.SETTINGS) and len(sweep.FAMILIES) >= 6
    assert len(set(sweep.FAMILIES.values())) >= 3
    for task in sweep.FAMILIES:
        assert len(learn_task.rows(task, 2, learn_task.TRAIN_SEED)) == 2
