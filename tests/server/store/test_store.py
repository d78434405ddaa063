"""The run store: migrations, WAL, retention, and JSON that strict readers accept."""

import json
import math
import sqlite3

import pytest

from server.store import MIGRATIONS, Store

pytestmark = pytest.mark.unit


def _old_store(path, version: int) -> sqlite3.Connection:
    """A store as a server that knew only the first `version` migrations left it (autocommit)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER)")
    db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    for sql in MIGRATIONS[:version]:
        for statement in (s for s in sql.split(";") if s.strip()):
            db.execute(statement)
    return db


def _traj(reward: float) -> dict:
    return {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": reward, "metrics": {"x": math.nan}}


def test_schema_is_migrated_once_and_survives_reopening(tmp_path):
    path = tmp_path / "s.sqlite"
    store = Store(path)
    store.runs.add("r", "p")
    again = Store(path)
    assert [r["name"] for r in again.runs.all()] == ["r"]
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_run_recorded_before_migration_9_keeps_its_owner_and_project_not_its_spec(tmp_path):
    path = tmp_path / "s.sqlite"
    db = _old_store(path, 8)  # a data dir written before run.json became the one record of a run
    db.execute("INSERT INTO runs (name, project, spec, created, owner, base_model, base_fingerprint) "
               "VALUES ('r', 'p', '{}', 1.0, 'alice', 'artisan-tiny', 'abc')")
    db.close()
    assert Store(path).runs.all() == [{"name": "r", "project": "p", "created": 1.0, "owner": "alice"}]
    columns = [c[1] for c in sqlite3.connect(path).execute("PRAGMA table_info(runs)")]
    assert columns == ["name", "project", "created", "owner"]


def test_non_finite_metrics_are_stored_as_null(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.steps.put("r", 1, "rl", {"logprob_gap": math.inf}, [], [(0, 0, 1.0, _traj(1.0))])
    assert store.steps.of("r")[0]["metrics"]["logprob_gap"] is None
    raw = sqlite3.connect(tmp_path / "s.sqlite").execute("SELECT data FROM trajectories").fetchone()[0]
    assert json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))["metrics"]["x"] is None


def test_retention_keeps_newest_steps_and_all_metrics(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for step in range(1, 6):
        store.steps.put("r", step, "rl", {"reward_mean": step / 10}, [], [(0, i, 0.5, _traj(0.5)) for i in range(3)])
    store.steps.put("other", 1, "rl", {}, [], [(0, 0, 0.5, _traj(0.5))])
    deleted = store.trajectories.prune("r", keep_steps=2)
    assert deleted == 9
    assert sorted({t["step"] for t in store.trajectories.of("r")}) == [4, 5]
    assert [s["step"] for s in store.steps.of("r")] == [1, 2, 3, 4, 5]  # metrics are kept
    assert len(store.trajectories.of("other")) == 1


def test_every_attempt_is_kept_in_order_trained_or_not(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.steps.put_attempt("r", 1, "rl", "job-a", "untrained", {"groups_total": 2},
                            ["All 2 groups had the same reward"])
    store.steps.put("r", 1, "rl", {"groups_total": 2, "trained": True}, [], [(0, 0, 1.0, _traj(1.0))], job_id="job-b")
    store.steps.put_attempt("other", 1, "rl", "job-c", "failed", {}, ["boom"])
    got = store.steps.attempts("r")
    assert [(a["attempt"], a["step"], a["trained"], a["outcome"], a["job_id"]) for a in got] == [
        (1, 1, False, "untrained", "job-a"), (2, 1, True, "trained", "job-b")]
    assert got[0]["warnings"] == ["All 2 groups had the same reward"] and got[0]["metrics"] == {"groups_total": 2}
    assert [a["attempt"] for a in store.steps.attempts("other")] == [1]  # numbered per run
    with pytest.raises(ValueError):  # a trained attempt comes with its step (steps.put), never alone
        store.steps.put_attempt("r", 2, "rl", "job-d", "trained", {}, [])


def test_a_pending_step_settles_its_attempt_with_it(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.steps.put("r", 1, "rl", {}, [], [(0, 0, 1.0, _traj(1.0))], pending=True, job_id="job-a")
    assert store.steps.attempts("r")[0]["pending"] and store.steps.of("r") == []
    store.steps.settle_pending("r", checkpointed={1})  # its checkpoint was written: it happened
    assert [s["step"] for s in store.steps.of("r")] == [1]
    assert store.steps.attempts("r")[0]["pending"] is False and store.steps.attempts("r")[0]["trained"] is True

    store.steps.put("r", 2, "rl", {}, ["a warning"], [(0, 0, 1.0, _traj(1.0))], pending=True, job_id="job-b")
    store.steps.settle_pending("r", checkpointed={1})  # its checkpoint was never written: it did not happen
    assert [s["step"] for s in store.steps.of("r")] == [1] and store.trajectories.of("r", step=2) == []
    lost = store.steps.attempts("r")[1]
    assert (lost["trained"], lost["pending"], lost["outcome"]) == (False, False, "interrupted")
    assert lost["warnings"][0] == "a warning" and "checkpoint was written" in lost["warnings"][1]

    store.steps.put("r", 2, "rl", {}, [], [], pending=True, job_id="job-c")
    store.steps.confirm("r", 2)
    assert [(a["outcome"], a["pending"]) for a in store.steps.attempts("r")][2] == ("trained", False)


def test_a_store_from_before_attempts_lists_its_steps_as_trained_attempts(tmp_path):
    path = tmp_path / "s.sqlite"
    db = _old_store(path, 2)
    for step in (1, 2):
        db.execute("INSERT INTO steps (run, step, kind, metrics, warnings, created, pending) VALUES (?, ?, ?, ?, ?, ?, 0)",
                   ("old", step, "rl", json.dumps({"reward_mean": step / 4}), json.dumps([]), float(step)))
    db.close()
    got = Store(path).steps.attempts("old")
    assert [(a["attempt"], a["step"], a["trained"], a["outcome"]) for a in got] == [(1, 1, True, "trained"),
                                                                                   (2, 2, True, "trained")]
    assert got[1]["metrics"] == {"reward_mean": 0.5}
