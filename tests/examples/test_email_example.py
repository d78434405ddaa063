"""The email example without a server: the generated mailbox, its SQLite full-text search, the
tools as the model sees them (errors included), exact match, the splits, and the judge's figures
as client.train sums them."""

from __future__ import annotations

import sqlite3

import pytest

from client.loop.summary import Summary, judge_figures
from examples.email import EVAL_SIZE, make_example
from examples.email.answers import exact_match
from examples.email.mailbox import SearchError, generate, mailbox_path
from protocol.trajectory import Trajectory, TrajectoryGroup
from rewards.ruler import JudgeError
from rollouts.env import ToolError

pytestmark = pytest.mark.unit

SIZE = 1500  # a smaller mailbox than the example's 4000, the same generator


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return make_example(size=SIZE, cache=tmp_path_factory.mktemp("email-cache"))


def test_mailbox_is_a_pure_function_of_its_seed():
    a, b, other = generate(7, 300), generate(7, 300), generate(8, 300)
    assert a == b
    assert a != other
    messages, facts = a
    assert [m.id for m in messages] == [f"m{i:04d}" for i in range(1, 301)]
    assert [m.date for m in messages] == sorted(m.date for m in messages)
    assert {f.kind for f in generate(7, 2000)[1]} == {"amount", "date", "place", "order_number", "code"}
    for fact in facts:  # the answer is written in the message it names
        assert fact.answer in next(m.body for m in messages if m.id == fact.message_id)


def test_questions_name_their_fact_unambiguously():
    _, facts = generate(7, 2000)
    keys = {}
    for fact in facts:
        keys.setdefault(fact.key, set()).add(fact.message_id)
    assert all(len(ids) == 1 for ids in keys.values())


def test_built_once_into_the_cache_with_full_text_search(tmp_path):
    path = mailbox_path(5, 400, tmp_path)
    assert path.parent == tmp_path and path.exists()
    built = path.stat().st_mtime_ns
    assert mailbox_path(5, 400, tmp_path) == path and path.stat().st_mtime_ns == built  # not rebuilt
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM messages").fetchone()[0] == 400
    assert db.execute("SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'invoice'").fetchone()[0] > 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_search_finds_the_source_of_every_held_out_question(example):
    mailbox = example.mailbox
    for task in example.eval_tasks():
        hits = mailbox.search(task.data["question"], max_results=10)
        assert task.data["message_id"] in [h["message_id"] for h in hits], task.data
    assert len(example.eval_tasks()) == EVAL_SIZE


def test_search_filters_and_bad_input(example):
    mailbox = example.mailbox
    hits = mailbox.search("invoice", sender="billing@gadget", sent_after="2024-03-01", sent_before="2024-03-31",
                          max_results=50)
    assert hits and all(h["from"].startswith("billing@gadget") and "2024-03-01" <= h["date"] < "2024-04-01" for h in hits)
    assert mailbox.search("zzzqqq") == []
    assert mailbox.search(["desk", "lamp"], max_results=3)
    for kwargs, words in [({}, "keywords, a sender or a date"), ({"keywords": "x", "sent_after": "March 3"}, "2024-03-31"),
                          ({"keywords": "x", "sent_before": "2024-02-30"}, "calendar"),
                          ({"keywords": "x", "max_results": 0}, "1 to 50"), ({"keywords": 3}, "string")]:
        with pytest.raises(SearchError, match=words):
            mailbox.search(**kwargs)
    # FTS5 syntax in keywords is searched as words, never parsed as a query
    assert isinstance(mailbox.search('"unbalanced AND (NEAR* -'), list)
    message = mailbox.read("m0001")
    assert message["message_id"] == "m0001" and message["body"]
    with pytest.raises(SearchError, match="no message with id"):
        mailbox.read("m9999")


def test_train_and_held_out_questions_are_about_different_messages(example):
    train = {t.data["message_id"] for t in example.train_tasks(0)}
    held_out = {t.data["message_id"] for t in example.eval_tasks()}
    assert train and held_out and not train & held_out
    assert example.train_tasks(0) == example.train_tasks(1)  # fixed: client.train draws with its seed


@pytest.mark.parametrize("kind,answer,reference,match", [
    ("amount", "The total was $1,234.50.", "$1234.50", True),
    ("amount", "1234.5 dollars", "$1234.50", True),
    ("amount", "$12.00 or $14.00", "$12.00", False),
    ("amount", "Order W1234567 cost $80", "$80.00", True),
    ("date", "It arrives March 4.", "March 4, 2024", True),
    ("date", "2024-03-04", "March 4, 2024", True),
    ("date", "4 March 2024", "March 4, 2024", True),
    ("date", "3/4/2024", "March 4, 2024", True),
    ("date", "March 5, 2024", "March 4, 2024", False),
    ("date", "March 4, 2023", "March 4, 2024", False),
    ("order_number", "Order #w1234567", "#W1234567", True),
    ("order_number", "W1234568", "#W1234567", False),
    ("code", "Your code is qx7k2p", "QX7K2P", True),
    ("code", "QX7K2P for LISBON", "QX7K2P", True),
    ("code", "QX7K2P or QX7K2R", "QX7K2P", False),
    ("place", "In Room 4B.", "Room 4B", True),
    ("place", "at the harbor cafe", "the Harbor Cafe", True),
    ("place", "Room 4B or Room 7C", "Room 4B", False),
    ("place", "", "Room 4B", False),
])
def test_exact_match_normalises_the_fact(kind, answer, reference, match):
    assert exact_match(kind, answer, reference) is match


async def test_tools_report_errors_to_the_model_and_the_answer_ends_the_episode(example):
    task = example.eval_tasks()[0]
    env = example.make_env(task)

    async def call(name, **args):
        return await env.call_tool(name, args)

    hits = await call("search_inbox", keywords=task.data["question"])
    assert task.data["message_id"] in [h["message_id"] for h in hits]
    for name, args, words in [("read_email", {"message_id": "m9999"}, "no message"),
                              ("read_email", {}, "needs message_id"),
                              ("search_inbox", {"query": "x"}, "takes no argument query"),
                              ("delete_email", {}, "unknown tool"),
                              ("answer", {"answer": "", "sources": []}, "answer needs"),
                              ("answer", {"answer": "x", "sources": [3]}, "list of message ids")]:
        with pytest.raises(ToolError, match=words):
            await call(name, **args)
    assert not env.finished()
    await call("read_email", message_id=task.data["message_id"])
    assert await call("answer", answer=task.data["answer"], sources=[task.data["message_id"]]) == "Answer recorded."
    assert env.finished()
    with pytest.raises(ToolError, match="already answered"):
        await call("answer", answer="again", sources=[])
    score = await env.score([])
    assert score.reward == 1.0
    assert score.metrics["cited_source"] and score.metrics["read_source"] and score.metrics["tool_errors"] == 7


async def test_a_wrong_or_missing_answer_scores_zero(example):
    task = example.eval_tasks()[0]
    env = example.make_env(task)
    assert (await env.score([{"role": "assistant", "content": "I could not find it."}])).reward == 0.0
    assert (await env.score([])).reward == 0.0


def test_judge_figures_of_a_step_count_malformed_replies_of_judged_and_failed_groups():
    judged = TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])],
                             metadata={"ruler": {"judged": 1, "failed": 0, "attempts": 2, "malformed": 1}})
    failed = TrajectoryGroup(exceptions=["JudgeError: ..."],
                             metadata=JudgeError("no verdict", attempts=3, malformed=3).group_metadata)
    plain = TrajectoryGroup(trajectories=judged.trajectories)
    assert judge_figures([judged, failed, plain]) == {"judged": 1, "failed": 1, "skipped": 0, "attempts": 5,
                                                      "malformed": 4}
    assert judge_figures([plain]) is None


def test_summary_totals_the_judge_over_steps(tmp_path):
    summary = Summary(tmp_path / "summary.json", "r", resumed_at=0)
    summary.evals = [{"step": 0, "reward": 0.0}, {"step": 2, "reward": 0.5}]
    summary.history = [{"step": 1, "judge": {"judged": 2, "failed": 0, "skipped": 0, "attempts": 3, "malformed": 1}},
                       {"step": 2, "judge": {"judged": 1, "failed": 1, "skipped": 1, "attempts": 4, "malformed": 2}}]
    assert summary.write()["judge"] == {"judged": 3, "failed": 1, "skipped": 1, "attempts": 7, "malformed": 3}
