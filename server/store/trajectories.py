"""The trajectories table: every trajectory trained or logged, with its token ids and logprobs, and its search."""

from __future__ import annotations

import json
import time
from typing import Any

from server.store.database import Database
from server.store.encoding import dumps

Rows = list[tuple[int, int, float, dict[str, Any]]]  # (group index, trajectory index, reward, trajectory)


class Trajectories:
    def __init__(self, db: Database):
        self._db = db

    def put(self, run: str, step: int, split: str, trajectories: Rows) -> None:
        self._db.write(insert(run, step, split, trajectories, time.time()))

    def prune(self, run: str, keep_steps: int) -> int:
        """Retention: drop the trajectories of all but the newest `keep_steps` steps of a run (step
        metrics and warnings are small and always kept). Returns the rows deleted."""
        newest = self._db.rows("SELECT MAX(step) AS newest FROM trajectories WHERE run = ?", (run,))[0]["newest"]
        if newest is None:
            return 0
        return self._db.execute("DELETE FROM trajectories WHERE run = ? AND step <= ?", (run, newest - keep_steps))

    def steps(self, run: str) -> list[int]:
        """The steps of `run` that have trajectories, in order."""
        return [r["step"] for r in
                self._db.rows("SELECT DISTINCT step FROM trajectories WHERE run = ? ORDER BY step", (run,))]

    def of(self, run: str, step: int | None = None, split: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT id, step, split, group_index, traj_index, reward, data FROM trajectories WHERE run = ?", [run]
        if step is not None:
            sql, args = sql + " AND step = ?", args + [step]
        if split is not None:
            sql, args = sql + " AND split = ?", args + [split]
        rows = self._db.rows(sql + " ORDER BY step, group_index, traj_index", tuple(args))
        for r in rows:
            r["data"] = json.loads(r["data"])
        return rows

    # ---- browsing (the web UI) --------------------------------------------------------------
    def reward_by_step(self, run: str) -> list[dict[str, Any]]:
        """Mean reward and count per (split, step): the reward curves, without loading any JSON."""
        return self._db.rows("SELECT split, step, COUNT(*) AS n, AVG(reward) AS reward_mean FROM trajectories "
                             "WHERE run = ? GROUP BY split, step ORDER BY split, step", (run,))

    def find(self, run: str, step: int | None = None, split: str | None = None,
             group: int | None = None, min_reward: float | None = None,
             max_reward: float | None = None, meta_key: str | None = None,
             meta_value: str | None = None, text: str | None = None,
             limit: int = 500) -> list[dict[str, Any]]:
        """Trajectory summaries (no messages, tokens or logprobs) matching every filter given.

        The JSON filters run inside SQLite so a search never ships every trajectory's token data
        to Python. `meta_value` matches the metadata value's text form (`true`, `3`, `retail`);
        `text` is a case-insensitive substring of any message content or tool-call arguments.
        """
        where, args = ["run = ?"], [run]
        for clause, value in (("step = ?", step), ("split = ?", split), ("group_index = ?", group),
                              ("reward >= ?", min_reward), ("reward <= ?", max_reward)):
            if value is not None:
                where.append(clause)
                args.append(value)
        json_where, json_args = [], []
        if meta_key:
            # json_each rather than a json path built from the key: the key is data, never syntax.
            json_where.append("EXISTS (SELECT 1 FROM json_each(doc, '$.metadata') WHERE key = ? AND "
                              "(CASE WHEN type IN ('true', 'false', 'null') THEN type "
                              "WHEN type IN ('object', 'array') THEN value ELSE CAST(atom AS TEXT) END) = ?)")
            json_args += [meta_key, meta_value or ""]
        if text:
            escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            json_where.append("EXISTS (SELECT 1 FROM json_tree(doc, '$.messages_and_choices') "
                              "WHERE key IN ('content', 'text', 'arguments') AND type = 'text' "
                              "AND value LIKE ? ESCAPE '\\')")
            json_args.append(f"%{escaped}%")
        # `doc` is the row as SQLite-readable JSON: json.dumps writes NaN for a NaN metric, which
        # SQLite's JSON functions reject, so those rare rows are rewritten (NaN as null) on the fly.
        rows = self._db.rows("SELECT id, step, split, group_index, traj_index, reward, "
                             "json_extract(doc, '$.metadata') AS metadata, json_extract(doc, '$.metrics') AS metrics "
                             "FROM (SELECT *, CASE WHEN json_valid(data) THEN data ELSE artisan_strict_json(data) END "
                             "AS doc "
                             f"FROM trajectories WHERE {' AND '.join(where)}) "
                             f"WHERE {' AND '.join(json_where) or '1'} "
                             "ORDER BY step, split, group_index, traj_index LIMIT ?", (*args, *json_args, limit))
        for r in rows:
            r["metadata"], r["metrics"] = json.loads(r["metadata"] or "{}"), json.loads(r["metrics"] or "{}")
        return rows

    def get(self, traj_id: int) -> dict[str, Any] | None:
        rows = self._db.rows("SELECT id, run, step, split, group_index, traj_index, reward, data FROM trajectories "
                             "WHERE id = ?", (traj_id,))
        if not rows:
            return None
        rows[0]["data"] = json.loads(rows[0]["data"])
        return rows[0]


def insert(run: str, step: int, split: str, trajectories: Rows, now: float) -> list[tuple[str, tuple]]:
    """The statements that store a step's trajectories (for a write of their own or a step's)."""
    return [("INSERT INTO trajectories (run, step, split, group_index, traj_index, reward, data, created) "
             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (run, step, split, g, t, r, dumps(d), now))
            for g, t, r, d in trajectories]


def trajectory_rows(groups: list[Any]) -> Rows:
    """Groups as the store keeps them: (group index, trajectory index, reward, trajectory)."""
    return [(gi, ti, t.reward, t.model_dump(mode="json"))
            for gi, g in enumerate(groups) for ti, t in enumerate(g.trajectories)]
