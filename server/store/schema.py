"""The run store's schema: its migrations in order, each applied once and numbered by its place (never renumber)."""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE runs (name TEXT PRIMARY KEY, project TEXT, spec TEXT, created REAL);
    CREATE TABLE steps (run TEXT, step INTEGER, kind TEXT, metrics TEXT, warnings TEXT, created REAL,
                        PRIMARY KEY (run, step));
    CREATE TABLE jobs (id TEXT PRIMARY KEY, run TEXT, kind TEXT, idempotency_key TEXT, status TEXT,
                       result TEXT, error TEXT, created REAL, updated REAL);
    CREATE UNIQUE INDEX jobs_key ON jobs (run, idempotency_key);
    CREATE TABLE job_events (job_id TEXT, seq INTEGER, type TEXT, data TEXT, created REAL,
                             PRIMARY KEY (job_id, seq));
    CREATE TABLE trajectories (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT, step INTEGER, split TEXT,
                               group_index INTEGER, traj_index INTEGER, reward REAL, data TEXT, created REAL);
    CREATE INDEX traj_run_step ON trajectories (run, step, split);
    """,
    # 2: idempotency keys remember their body; jobs their current attempt; steps commit in two phases
    """
    ALTER TABLE jobs ADD COLUMN body_hash TEXT;
    ALTER TABLE jobs ADD COLUMN attempt_from INTEGER DEFAULT 0;
    ALTER TABLE steps ADD COLUMN pending INTEGER DEFAULT 0;
    """,
    # 3: every step attempt, trained or not; the steps a store already holds were trained attempts
    """
    CREATE TABLE attempts (run TEXT, attempt INTEGER, job_id TEXT, step INTEGER, kind TEXT, trained INTEGER,
                           outcome TEXT, warnings TEXT, metrics TEXT, created REAL, pending INTEGER DEFAULT 0,
                           PRIMARY KEY (run, attempt));
    INSERT INTO attempts (run, attempt, job_id, step, kind, trained, outcome, warnings, metrics, created, pending)
        SELECT run, ROW_NUMBER() OVER (PARTITION BY run ORDER BY step), NULL, step, kind, 1, 'trained',
               warnings, metrics, created, pending FROM steps;
    """,
    # 4: who created each run: a tenant's name, NULL for the admin (server/runs/ownership.py)
    """
    ALTER TABLE runs ADD COLUMN owner TEXT;
    """,
    # 5: the base model each run belongs to (server/runs/base_models.py); NULL for runs made before
    """
    ALTER TABLE runs ADD COLUMN base_model TEXT;
    ALTER TABLE runs ADD COLUMN base_fingerprint TEXT;
    """,
    # 6: the request of a job whose body the client cannot send again (a session job's assembled groups:
    # its sessions may have expired or been deleted), so that the job runs again when resubmitted after a restart
    """
    CREATE TABLE job_requests (job_id TEXT PRIMARY KEY, request TEXT, created REAL);
    """,
    # 7: recorded sessions (server/harness/sessions.py), so that they outlive a restart until they expire:
    # each exchange as JSON, token ids and logprobs exactly as sampled; `seq` orders a session's exchanges
    """
    CREATE TABLE sessions (owner TEXT, id TEXT, created REAL, touched REAL, taken_by TEXT, PRIMARY KEY (owner, id));
    CREATE TABLE session_exchanges (owner TEXT, session_id TEXT, seq INTEGER, exchange TEXT,
                                    PRIMARY KEY (owner, session_id, seq));
    """,
    # 8: kept Responses (server/harness/responses.py), so that previous_response_id and retrieval outlive a
    # restart until they expire: the body as answered, and the conversation and input items as JSON
    """
    CREATE TABLE kept_responses (id TEXT PRIMARY KEY, owner TEXT, model TEXT, created REAL, body TEXT,
                                 messages TEXT, input_items TEXT);
    """,
    # 9: a run's spec and base model are its run.json's alone (server/runs/base_models.py), not copied here too
    """
    ALTER TABLE runs DROP COLUMN spec;
    ALTER TABLE runs DROP COLUMN base_model;
    ALTER TABLE runs DROP COLUMN base_fingerprint;
    """,
]
