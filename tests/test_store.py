"""The run store: migrations, WAL, retention, and JSON that strict readers accept."""

import json
import math
import sqlite3

from server.store import MIGRATIONS, Store


def _traj(reward: float) -> dict:
    return {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": reward, "metrics": {"x": math.nan}}


def test_schema_is_migrated_once_and_survives_reopening(tmp_path):
    path = tmp_path / "s.sqlite"
    store = Store(path)
    store.put_run("r", "p", {"name": "r"})
    again = Store(path)
    assert [r["name"] for r in again.runs()] == ["r"]
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_non_finite_metrics_are_stored_as_null(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.put_step("r", 1, "rl", {"logprob_gap": math.inf}, [], [(0, 0, 1.0, _traj(1.0))])
    assert store.steps("r")[0]["metrics"]["logprob_gap"] is None
    raw = sqlite3.connect(tmp_path / "s.sqlite").execute("SELECT data FROM trajectories").fetchone()[0]
    assert json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))["metrics"]["x"] is None


def test_retention_keeps_newest_steps_and_all_metrics(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    for step in range(1, 6):
        store.put_step("r", step, "rl", {"reward_mean": step / 10}, [], [(0, i, 0.5, _traj(0.5)) for i in range(3)])
    store.put_step("other", 1, "rl", {}, [], [(0, 0, 0.5, _traj(0.5))])
    deleted = store.prune_trajectories("r", keep_steps=2)
    assert deleted == 9
    assert sorted({t["step"] for t in store.trajectories("r")}) == [4, 5]
    assert [s["step"] for s in store.steps("r")] == [1, 2, 3, 4, 5]  # metrics are kept
    assert len(store.trajectories("other")) == 1
